"""fx16.program.cost: FLOPs and bytes from the shapes export recorded, checked against PyTorch's
own FLOP counter (torch.utils.flop_counter) on the products it knows."""

import pytest
import torch
import torch.nn.functional as F
from fuzz_profile import examples
from hypothesis import given, settings
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import zoo
from fx16.program.cost import bytes_moved, elements, flops, is_product
from fx16.program.subgraphs import nested_graph_modules
from fx16.testing import programs
from fx16.testing.random_programs import MENU
from helpers import export


class Products(nn.Module):
    """Every kind of product fx16 counts, on small shapes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)
        self.conv = nn.Conv2d(4, 8, 3, padding=1, groups=2)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.weight = nn.Parameter(torch.randn(24, 12))

    def forward(self, x, image, q):
        h = self.fc(x)  # (2, 5, 24)
        a = h @ self.weight  # matmul
        b = torch.bmm(a, a.transpose(1, 2))  # (2, 5, 5)
        c = torch.einsum("bij,bjk->bik", b, a)
        d = torch.addmm(torch.zeros(5, 12), b[0], a[0])
        attention = F.scaled_dot_product_attention(q, q, q)
        return c.sum() + d.sum() + self.up(self.conv(image)).sum() + attention.sum()


def _product_flops(ep) -> int:
    return sum(
        flops(node)
        for module in nested_graph_modules(ep.graph_module)
        for node in module.graph.nodes
        if is_product(node)
    )


def _counted(model, *args) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*args)
    return counter.get_total_flops()


def test_every_product_kind_counts_what_pytorchs_counter_counts():
    """The counter does not see the CPU attention kernel: attention is checked by its
    formula, 2 L S (E + Ev) per batch and head."""
    torch.manual_seed(0)
    args = (torch.randn(2, 5, 16), torch.randn(1, 4, 6, 6), torch.randn(1, 2, 7, 8))
    model = Products().eval()
    ep = export(model, *args)
    products = {n.target._opname: n for n in ep.graph_module.graph.nodes if is_product(n)}
    assert {"linear", "matmul", "bmm", "einsum", "addmm", "conv2d", "conv_transpose2d"} <= set(
        products
    )
    attention = flops(products.pop("scaled_dot_product_attention"))
    assert attention == 2 * (1 * 2) * 7 * 7 * (8 + 8)
    assert _product_flops(ep) - attention == _counted(model, *args)


@pytest.mark.parametrize("build", [lambda: zoo.gpt2(layers=2), zoo.ResNetish])
def test_a_models_products_count_what_pytorchs_counter_counts(build):
    torch.manual_seed(0)
    model = build().eval()
    args = (
        (torch.randint(0, 1024, (1, 16)),)
        if hasattr(model, "model")
        else (torch.randn(1, 3, 16, 16),)
    )
    ep = export(model, *args)
    assert _product_flops(ep) == _counted(model, *args)


def test_other_ops_count_an_element_each_and_bytes_count_what_moves():
    class Elementwise(nn.Module):
        def forward(self, x):
            return x.exp().sum(-1)

    ep = export(Elementwise(), torch.randn(4, 8))
    nodes = {node.name: node for node in ep.graph_module.graph.nodes}
    assert flops(nodes["exp"]) == 32 and flops(nodes["sum_1"]) == 32
    assert not is_product(nodes["exp"])
    assert bytes_moved(nodes["exp"]) == 2 * 32 * 4  # reads and writes 32 fp32 values
    assert bytes_moved(nodes["sum_1"]) == (32 + 4) * 4
    assert flops(nodes["x"]) == 0  # placeholders compute nothing
    assert elements(nodes["exp"]) == 32 and elements(nodes["sum_1"]) == 4  # what each produces
    assert elements(nodes["x"]) == 0


def test_elements_count_every_tensor_a_result_holds():
    class Split(nn.Module):
        def forward(self, x):
            values, indices = x.max(-1)
            return values, indices

    ep = export(Split(), torch.randn(4, 8))
    node = next(n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.max.dim)
    assert elements(node) == 4 + 4  # the maxima and their indices


# PyTorch's counter cannot run a while_loop or a map; and fx16 counts each body once per
# call (both branches of a cond, a loop's body once), where the counter counts what runs.
_STRAIGHT = tuple(op for op in MENU if op not in ("while_loop", "map", "cond"))


@settings(max_examples=examples(12), deadline=None)
@given(programs(menu=_STRAIGHT))
def test_property_any_programs_products_count_what_pytorchs_counter_counts(case):
    """Random straight-line programs: matmuls, convolutions, linears among the rest."""
    ep = case.export()
    assert _product_flops(ep) == _counted(case.model, *case.args)


class Recurrent(nn.Module):
    """An LSTM (two layers, both directions), a GRU and a plain RNN over one sequence."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(16, 5, batch_first=True)
        self.rnn = nn.RNN(5, 4, nonlinearity="relu", batch_first=True)

    def forward(self, x):
        h, _ = self.lstm(x)
        g, _ = self.gru(h)
        return self.rnn(g)[0]


def test_recurrent_layers_count_their_gate_products():
    """Input graph: lstm.input -> gru.input -> rnn_relu.input. Each counts 2 FLOPs per
    weight-matrix element and (step, batch) row (PyTorch's counter sees none of it: the
    CPU runs them in one oneDNN kernel), and is a product the 16-bit share counts."""
    torch.manual_seed(0)
    x = torch.randn(3, 7, 6)
    model = Recurrent().eval()
    ep = export(model, x)
    recurrent = [n for n in ep.graph_module.graph.nodes if is_product(n)]
    assert {n.target._opname for n in recurrent} == {"lstm", "gru", "rnn_relu"}
    rows = 3 * 7
    lstm = 2 * rows * (4 * 8 * 6 + 4 * 8 * 8) * 2 + 2 * rows * (4 * 8 * 16 + 4 * 8 * 8) * 2
    gru = 2 * rows * (3 * 5 * 16 + 3 * 5 * 5)
    rnn = 2 * rows * (4 * 5 + 4 * 4)
    assert [flops(n) for n in recurrent] == [lstm, gru, rnn]


# ATen ops whose names read like a product but which fx16 rightly does not count as one
# (every other such op must be in COMPUTE_OPS, with its formula in fx16.program.cost).
NOT_PRODUCTS = {
    "addr": "an outer product added: one multiply per output element, no contraction",
    "outer": "an outer product: one multiply per output element",
    "kron": "a Kronecker product: one multiply per output element",
    "_thnn_fused_lstm_cell": "the gates' pointwise part; its products are separate mm ops",
    "_thnn_fused_gru_cell": "the gates' pointwise part; its products are separate mm ops",
    "mkldnn_rnn_layer": "the oneDNN kernel aten.lstm lowers to at run time, never exported",
    "_lstm_mps": "Apple's MPS kernel aten.lstm lowers to at run time, never exported",
    "_trilinear": "bilinear's internal kernel, never exported (bilinear is)",
    "_triton_multi_head_attention": "a CUDA Triton kernel, never exported",
    "_triton_scaled_dot_attention": "a CUDA Triton kernel, never exported",
    "_flash_attention_forward_no_dropout_inplace": "a CUDA kernel's in-place variant",
    "_cudnn_attention_forward": "a cuDNN kernel, never exported",
    "_compute_linear_combination": "a weighted sum of tensors (matrix functions)",
    "_nested_get_jagged_dummy": "a nested-tensor helper",
    "hamming_window": "a window function",
}


def test_every_aten_product_is_counted_or_named_as_not_one():
    """Every ATen op whose name reads like a matrix product, convolution, attention or
    recurrent layer (backward, in-place, out, sparse, vendor and quantized-engine kernels
    aside) is a product with a FLOP formula, or named above with why it is not."""
    import re

    from fx16.ops.kinds import COMPUTE_OPS
    from fx16.program.cost import _PRODUCTS

    assert set(COMPUTE_OPS) == set(_PRODUCTS)
    product = re.compile(
        r"(mm|conv|lstm|gru|rnn|attention|linear|einsum|matmul|dot|tensordot|bilinear|"
        r"^mv|_mv|kron|inner|^outer|addr|chain_matmul|multi_dot)"
    )
    aside = re.compile(
        r"(backward|_$|_out$|^_foreach|upsample|gamma|cummax|cummin|^_convert_weight|"
        r"overrideable$|^_nnpack|prepack|reorder|^_mps|_mps$|depthwise|miopen|cudnn_(?!attention)|"
        r"^fbgemm|^quantized_|sparse|^_cslt|spaddmm|hspmm|^smm$|^_validate|^_to_|^_convert_indices)"
    )
    names = {
        name.split("::")[1].split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
    }
    unknown = {
        name
        for name in names
        if product.search(name) and not aside.search(name) and name not in COMPUTE_OPS
    }
    assert unknown <= set(NOT_PRODUCTS), sorted(unknown - set(NOT_PRODUCTS))
