"""StoreAsReadPass: a state tensor whose every reader the inserter casts up to fp32 is
stored in fp32, not in 16-bit and cast up on every call."""

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from benchmarks import zoo
from fx16.decisions import PRECISION, Reason
from fx16.policy import PrecisionPolicy
from fx16.program.casts import is_inserted
from fx16.report import report_of
from fx16.testing import check_cast, programs
from helpers import check_program, export, max_error, node_named, run
from models import MLP


def _weights(ep) -> dict:
    return {
        n.name: n.meta[PRECISION]
        for n in ep.graph.nodes
        if n.op == "placeholder" and n.name.startswith("p_")
    }


def test_a_margin_that_keeps_every_op_fp32_keeps_every_weight_fp32():
    """overflow_margin=1e5: every activation counts as overflowing. Input graph:
    linear(x, w0) -> gelu -> linear(., w1). Output graph: the same, reading fp32 weights
    (once: each weight stored fp16 and cast up on every call, 5 casts per call); the one
    cast left is the output's, whose values fit."""
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(4, 8)
    ep = fx16.cast_fp32_to_fp16(export(model, x), overflow_margin=1e5, policy=NO_SCALING)
    check_program(ep)
    weights = _weights(ep)
    assert {d.reason for d in weights.values()} == {Reason.READERS_FP32}
    assert {t.dtype for t in ep.state_dict.values()} == {torch.float32}
    totals = report_of(ep).totals
    assert totals.casts_inserted == 1 and totals.weight_bytes_after == totals.weight_bytes_before
    with torch.no_grad():
        assert max_error([model(x)], run(ep, x)) < 1e-3  # fp32 throughout, the output rounded


# these tests are about values kept fp32 for range: scale domains would carry them 16-bit
NO_SCALING = PrecisionPolicy(scale_range=False)


class TiedAcrossPrecisions(nn.Module):
    """One tensor under two names: a product reads one in 16-bit, and a scaling past
    fp16's range (fp32, by the overflow rule) reads the other through a cast up."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(8, 8) * 0.1)
        self.b = self.a  # tied, as an embedding and a head are

    def forward(self, x):
        return x @ self.a, self.b * 1e6


def test_a_tensor_a_16_bit_op_reads_stays_16_bit_under_every_name():
    """Only a tensor every reader of every name casts up moves: here the product reads
    it in 16-bit, so it stays stored once, in 16-bit."""
    torch.manual_seed(0)
    ep = fx16.cast_fp32_to_fp16(
        export(TiedAcrossPrecisions(), torch.randn(4, 8)), policy=NO_SCALING
    )
    check_program(ep)
    assert {d.reason for d in _weights(ep).values()} == {Reason.FITS}
    assert {t.dtype for t in ep.state_dict.values()} == {torch.float16}
    mul = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    assert mul.meta[PRECISION].reason is Reason.ACTIVATION_OVERFLOW


def test_a_16_bit_program_stores_its_weights_16_bit():
    """The default cast of an MLP: every weight is read by a 16-bit op."""
    torch.manual_seed(0)
    ep = fx16.cast_fp32_to_fp16(export(MLP(), torch.randn(4, 8)))
    assert {d.reason for d in _weights(ep).values()} == {Reason.FITS}
    assert not any(is_inserted(n) for n in ep.graph.nodes)


def test_a_routers_gate_weight_is_stored_as_its_product_reads_it():
    """qwen2_moe: routing="fp32" keeps each gate's product fp32, which read its weight
    through a cast up on every call; now the weight is fp32. With routing="16-bit" the
    product and its weight are 16-bit."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, 8))
    kept = fx16.cast_fp32_to_fp16(export(zoo.qwen2_moe(), ids))
    gate = node_named(kept, "p_model_model_layers_0_mlp_gate_weight")
    assert gate.meta[PRECISION].reason is Reason.READERS_FP32
    assert gate.meta["val"].dtype == torch.float32
    sixteen = fx16.cast_fp32_to_fp16(export(zoo.qwen2_moe(), ids), routing="16-bit")
    gate = node_named(sixteen, "p_model_model_layers_0_mlp_gate_weight")
    assert gate.meta[PRECISION].reason is Reason.FITS


@settings(max_examples=examples(10), deadline=None)
@given(programs(), st.sampled_from([2.0, 1e3]))
def test_property_no_weight_is_stored_16_bit_only_to_be_cast_up(case, margin):
    """Random programs, cast with the default margin and with one that keeps most ops
    fp32: the result is within the float oracle's bound, no 16-bit state tensor is read
    only through fx16's casts to fp32, and each ``readers_fp32`` tensor is fp32 and read
    without one."""
    from fx16.program.casts import cast_dtype, is_cast

    ep = check_cast(case, lambda ep: fx16.cast_fp32_to_fp16(ep, overflow_margin=margin))
    for node in ep.graph.nodes:
        decided = node.meta.get(PRECISION)
        if node.op != "placeholder" or decided is None or not node.users:
            continue
        casts_up = [
            u
            for u in node.users
            if is_inserted(u) and is_cast(u) and cast_dtype(u) == torch.float32
        ]
        if decided.reason is Reason.READERS_FP32:
            assert node.meta["val"].dtype == torch.float32 and not casts_up, node.name
        elif node.name.startswith(("p_", "b_", "c_")) and decided.narrowed:
            assert len(casts_up) < len(node.users), node.name


class OneNameTwoReaders(nn.Module):
    """One weight under one name, read by a product in 16-bit and by a scaling past
    fp16's range that computes in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.1)

    def forward(self, x):
        return x @ self.weight, self.weight * 1e6


def test_a_weight_one_reader_of_which_computes_16_bit_stays_16_bit():
    """Input: w read by matmul (16-bit) and by w * 1e6 (fp32 for range). Output: w
    stored fp16, cast up for the fp32 reader only; stored fp32 it would double its bytes
    for the product's sake of nothing."""
    torch.manual_seed(0)
    ep = fx16.cast_fp32_to_fp16(export(OneNameTwoReaders(), torch.randn(4, 8)), policy=NO_SCALING)
    check_program(ep)
    assert ep.state_dict["weight"].dtype == torch.float16
    assert _weights(ep)["p_weight"].reason is Reason.FITS
    mul = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    assert mul.meta[PRECISION].dtype == torch.float32


def test_the_pass_alone_stores_the_weights_fp32_and_says_what_it_did():
    """The pipeline up to the inserter, then StoreAsReadPass alone: it reports
    ``modified`` and hands back the module it was given; each weight's placeholder is
    fp32 (value and decision, ``readers_fp32``, chosen by ``stored_as_read``), its
    pending 16-bit conversion dropped, no cast reads it; run again, it changes nothing
    and says so."""
    from fx16.passes import StoreAsReadPass
    from fx16.program import Program
    from fx16.program.casts import is_cast
    from fx16.program.snapshot import PENDING

    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(4, 8)
    ep = export(model, x)
    passes = fx16.fp16_passes(ep, overflow_margin=1e5, policy=NO_SCALING)
    before = passes[: next(i for i, p in enumerate(passes) if isinstance(p, StoreAsReadPass))]
    with Program.of(ep).transaction():  # the weights' conversions pending, as in a cast
        for stage in before:
            stage(ep.graph_module)
        slots = Program.of(ep).state_slots()
        assert set(ep.graph_module.meta[PENDING]) == {slot.target for slot in slots}
        result = StoreAsReadPass(Program.of(ep))(ep.graph_module)
        assert result.modified is True and result.graph_module is ep.graph_module
        assert not ep.graph_module.meta.get(PENDING)  # every conversion dropped
        for placeholder in (slot.placeholder for slot in slots):
            made = placeholder.meta[PRECISION]
            assert placeholder.meta["val"].dtype == torch.float32
            assert (made.dtype, made.reason) == (torch.float32, Reason.READERS_FP32)
            assert placeholder.meta["fx16.planned"].rule == "stored_as_read"
            assert not any(is_cast(user) for user in placeholder.users)
        again = StoreAsReadPass(Program.of(ep))(ep.graph_module)
        assert again.modified is False and again.graph_module is ep.graph_module
    assert {t.dtype for t in ep.state_dict.values()} == {torch.float32}
