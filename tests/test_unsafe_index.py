"""UnsafeIndexAnalysis: values that flow into index arguments, along every path."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fx16.analysis import UnsafeIndexAnalysis
from helpers import export
from models import GatherComputedIndex, PositionsAndMask

KEY = UnsafeIndexAnalysis.META_KEY


def _analyse(ep):
    code = ep.graph_module.code
    assert not UnsafeIndexAnalysis()(ep.graph_module).modified
    assert ep.graph_module.code == code
    return {node.name: node.meta[KEY] for node in ep.graph_module.graph.nodes}


def test_embedding_ids_positions_and_mask_paths():
    """ids -> embedding; arange -> unsqueeze -> embedding; mask -> to -> cumsum -> sub -> clamp
    -> embedding: all unsafe. ids % 7 and ids * ids do not feed an index."""
    args = (torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.bool))
    found = _analyse(export(PositionsAndMask(), *args))
    for name in ("ids", "mask", "arange", "unsqueeze", "to", "cumsum", "sub", "clamp"):
        assert found[name], name
    for name in ("remainder", "add_2", "mul", "embedding"):
        assert not found[name], name


def test_computed_gather_index_is_unsafe_upstream():
    """ids -> add -> remainder -> gather(index): all three unsafe; the second ids + ids is safe."""
    ep = export(GatherComputedIndex(), torch.randn(2, 5), torch.randint(0, 5, (2, 3)))
    found = _analyse(ep)
    assert found["ids"] and found["add"] and found["remainder"]
    assert not found["add_1"] and not found["gather"]


class Indexing(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x, ids):
        index = ids * 1 + 0  # one op between the input and the index
        if self.kind == "index":
            return x[index]
        if self.kind == "index_put":
            return x.index_put((index,), torch.ones(index.shape[0]))
        if self.kind == "index_select":
            return x.index_select(0, index)
        if self.kind == "scatter_add":
            return x.scatter_add(0, index, torch.ones(index.shape[0]))
        if self.kind == "index_add":
            return x.index_add(0, index, torch.ones(index.shape[0]))
        if self.kind == "one_hot":
            return F.one_hot(index, 8)
        if self.kind == "nll_loss":
            return F.nll_loss(x.unsqueeze(0).expand(index.shape[0], -1), index)
        if self.kind == "take":
            return x.take(index)
        if self.kind == "item":
            return x[: index[0].item()]
        raise ValueError(self.kind)


KINDS = [
    "index",
    "index_put",
    "index_select",
    "scatter_add",
    "index_add",
    "one_hot",
    "nll_loss",
    "take",
    "item",
]


# Decomposed, one_hot becomes a comparison with arange: no index argument is left.
@pytest.mark.parametrize(
    "kind, decompose",
    [(kind, False) for kind in KINDS] + [(kind, True) for kind in KINDS if kind != "one_hot"],
)
def test_every_index_taking_op(kind, decompose):
    ep = export(Indexing(kind), torch.randn(8), torch.tensor([1, 3, 2]), decompose=decompose)
    found = _analyse(ep)
    assert found["ids"], f"{kind}: the input feeding the index is not marked"
    integer_ops = [
        n
        for n in ep.graph_module.graph.nodes
        if n.op == "call_function" and n.all_input_nodes and n.all_input_nodes[0].name == "ids"
    ]
    assert integer_ops and all(found[n.name] for n in integer_ops)
    assert not found["x"]


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(["add", "mul", "clamp", "neg_abs"]), min_size=1, max_size=5))
def test_every_node_on_the_way_to_an_index_is_marked(steps):
    """ids -> random integer ops -> embedding: every step is unsafe; a side branch is not."""

    class Path(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(100, 4)

        def forward(self, ids):
            side = ids * 3
            index = ids
            for step in steps:
                if step == "add":
                    index = index + 1
                elif step == "mul":
                    index = index * 1
                elif step == "clamp":
                    index = index.clamp(0, 90)
                else:
                    index = (-index).abs()
            return self.embed(index.clamp(0, 99)), side

    ep = export(Path(), torch.tensor([1, 2, 3]))
    found = _analyse(ep)
    embedding = next(
        n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.embedding.default
    )
    index = embedding.args[1]
    while index.op != "placeholder":
        assert found[index.name], index.name
        index = index.args[0]
    assert found["ids"]
    side = next(n for n in ep.graph_module.graph.nodes if n.op == "output").args[0][1]
    assert not found[side.name]


class BucketsInsideCond(torch.nn.Module):
    """Float positions become bucket ids inside a cond branch; the other branch returns
    a float result that only computes."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(16, 4)

    def forward(self, x):
        def buckets(a):
            ids = (a.abs() * 3).floor().clamp(max=15).long()
            return self.table(ids).sum(-1)

        def plain(a):
            return a * 2

        return torch.cond(x.sum() > 0, buckets, plain, (x * 5,))


def test_an_index_inside_a_branch_is_unsafe_on_both_sides_of_the_boundary():
    ep = export(BucketsInsideCond(), torch.rand(2, 3))
    found = _analyse(ep)
    assert found["mul"]  # x * 5 feeds the branch operand that becomes ids
    assert not found["cond"]
    (cond,) = [n for n in ep.graph_module.graph.nodes if n.target is torch.ops.higher_order.cond]
    taken = getattr(ep.graph_module, cond.args[1].target)
    inside = {n.name: n.meta[KEY] for n in taken.graph.nodes}
    assert all(inside[n] for n in ("mul", "abs_1", "mul_1", "floor", "clamp", "to"))
    assert not inside["sum_1"]


class IndexAndProductShareAnInput(torch.nn.Module):
    """x feeds a bucket index, ``(x[:, 0] * 4 + 8).long()``, and a Linear; ``tanh=True``
    puts a tanh between them."""

    def __init__(self, tanh: bool) -> None:
        super().__init__()
        self.tanh = tanh
        self.lin, self.emb = torch.nn.Linear(8, 8), torch.nn.Embedding(16, 8)

    def forward(self, x):
        shared = torch.tanh(x) if self.tanh else x
        index = (shared[:, 0] * 4 + 8).long().clamp(0, 15)
        return self.lin(shared) + self.emb(index)


@pytest.mark.parametrize("tanh", [False, True])
def test_a_value_kept_fp32_for_an_index_gives_its_other_readers_a_16_bit_copy(tanh):
    """Input graph: x -> select -> mul -> add -> long -> embedding; x -> linear. Output
    graph: the index path fp32 (the rule), the linear on a 16-bit copy of x. Once, with
    x a user input, the linear read x in fp32 (0% of the FLOPs in 16-bit), while a
    tanh's result gave it the copy; the index is computed as the fp32 program does."""
    import fx16
    from fx16.decisions import PRECISION, Reason
    from helpers import max_error, run

    torch.manual_seed(0)
    model, x = IndexAndProductShareAnInput(tanh).eval(), torch.randn(4, 8)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    assert fx16.report.report_of(ep).totals.flop_share_16bit == 1.0
    linear = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.linear.default)
    assert linear.args[0].meta["val"].dtype == torch.float16
    to_long = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.to.dtype)
    assert to_long.args[0].meta[PRECISION].reason is Reason.UNSAFE_INDEX
    with torch.no_grad():
        assert max_error([model(x)], run(ep, x)) < 1e-2
