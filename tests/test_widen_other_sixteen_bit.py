"""WidenOtherSixteenBitPass: a program made in the other 16-bit dtype (a bf16 checkpoint
cast to fp16, an export of ``model.half()`` cast to bf16) is widened to fp32 exactly and
then cast with the fp32 program's rules; a program with nothing to cast is refused."""

import copy
import dataclasses

import pytest
import torch
from fuzz_profile import examples
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from benchmarks import zoo
from fx16.passes import WidenOtherSixteenBitPass
from fx16.program import Program
from fx16.program.nodes import node_val, tensor_leaves
from fx16.program.stats import program_stats
from fx16.program.subgraphs import nested_graph_modules
from fx16.testing import programs
from fx16.testing.checks import check_cast_program, quiet
from helpers import (
    assert_same_state,
    check_program,
    export,
    fp64_reference,
    max_error,
    run,
    state_snapshot,
)
from models import MLP, AutocastRegions

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _dtypes(ep) -> set[torch.dtype]:
    """Every float dtype a value of the program has (bodies too) or its state holds."""
    held = {
        leaf.dtype
        for module in nested_graph_modules(ep.graph_module)
        for node in module.graph.nodes
        for leaf in tensor_leaves(node_val(node))
    }
    held |= {t.dtype for t in [*ep.state_dict.values(), *ep.constants.values()]}
    return {dtype for dtype in held if dtype.is_floating_point}


def _llama():
    torch.manual_seed(0)
    return zoo.llama(layers=2, vocab=64).eval(), torch.randint(0, 64, (2, 8))


def test_the_pass_alone_widens_a_bf16_program_exactly():
    """Input: a bf16 Llama's program (weights, norms, the model's own casts to bf16).
    Output: the same program in fp32: no bf16 value, dtype arguments included, and the
    outputs of the bf16 weights computed in fp32 (the eager model widened)."""
    model, ids = _llama()
    bf16 = copy.deepcopy(model).to(BF16)
    ep = export(bf16, ids)
    result = WidenOtherSixteenBitPass(Program.of(ep), BF16)(ep.graph_module)
    assert result.modified and BF16 not in _dtypes(ep)
    check_program(ep)
    widened = copy.deepcopy(bf16).float()
    with torch.no_grad():
        torch.testing.assert_close(run(ep, ids)[0], widened(ids), rtol=1e-5, atol=1e-5)
    again = WidenOtherSixteenBitPass(Program.of(ep), BF16)(ep.graph_module)
    assert not again.modified


def test_a_bf16_llama_is_cast_to_fp16():
    """cast_fp32_to_fp16 once left a bf16 program bf16. Now every value is fp16 or, for
    a stated cause, fp32; the error against the fp32 model's fp64 run is no worse than
    the bf16 program's own."""
    model, ids = _llama()
    bf16 = copy.deepcopy(model).to(BF16)
    ep = fx16.cast_fp32_to_fp16(export(bf16, ids))
    check_program(ep)
    assert BF16 not in _dtypes(ep)
    assert {t.dtype for t in ep.state_dict.values()} == {FP16}
    assert fx16.report.report_of(ep).totals.flop_share_16bit == 1.0
    reference = fp64_reference(model, ids)
    with torch.no_grad():
        own = max_error(reference, [bf16(ids).float()])
    assert max_error(reference, run(ep, ids)) <= own


class MixedPrecisionMLP(nn.Module):
    """bf16 linears around a LayerNorm kept fp32 (as transformers keeps some modules
    fp32 in a bf16 checkpoint), with the model's own casts between them."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16).to(BF16), nn.Linear(16, 4).to(BF16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.second(self.norm(self.first(x).float()).to(BF16))


def test_a_mixed_fp32_and_bf16_program_is_cast_to_fp16():
    torch.manual_seed(0)
    model, x = MixedPrecisionMLP().eval(), torch.randn(4, 8, dtype=BF16)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    assert BF16 not in _dtypes(ep)
    assert {t.dtype for t in ep.state_dict.values()} == {FP16}
    with torch.no_grad():  # the bf16 program's own roundings are finer in fp16
        assert max_error([model(x).float()], run(ep, x)) < 2e-2


class OwnBf16Rounding(nn.Module):
    """An fp32 program that rounds one value to bf16 itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).to(BF16).float() * 2


def test_an_fp32_program_keeps_its_own_bf16_cast():
    """The widening is for programs made in the other dtype (state or inputs); an fp32
    program's own rounding to bf16 is the model's, and stays."""
    torch.manual_seed(0)
    ep = export(OwnBf16Rounding(), torch.randn(2, 8))
    assert not WidenOtherSixteenBitPass(Program.of(ep), BF16)(ep.graph_module).modified
    fx16.cast_fp32_to_fp16(ep)
    assert BF16 in _dtypes(ep)


def test_a_half_program_is_cast_to_bf16_and_refused_for_fp16():
    """Exported from ``model.half()``: cast to fp16 there is nothing to do, said as an
    InvalidProgramError that leaves the program as it was (once: a silent no-op, while
    the command line refused it); a bf16 policy converts it."""
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(4, 8)
    ep = export(copy.deepcopy(model).half(), x.half())
    before = state_snapshot(ep)
    with pytest.raises(fx16.InvalidProgramError, match="computes in float16 already"):
        fx16.cast_fp32_to_fp16(ep)
    assert_same_state(before, state_snapshot(ep))
    fx16.cast_fp32_to_fp16(ep, policy="auto_mixed_bf16")
    check_program(ep)
    assert _dtypes(ep) == {BF16}
    assert max_error(fp64_reference(model, x), run(ep, x)) < 2e-2


def test_a_program_fx16_cast_is_not_cast_again_to_the_other_dtype():
    """Its decisions are about fp16: the fp32 program is the one to cast to bf16."""
    model, ids = _llama()
    ep = fx16.cast_fp32_to_fp16(export(model, ids))
    before = state_snapshot(ep)
    with pytest.raises(fx16.InvalidProgramError, match="cast this program to float16 already"):
        fx16.cast_fp32_to_fp16(ep, policy="auto_mixed_bf16")
    assert_same_state(before, state_snapshot(ep))


def test_int16_casting_leaves_a_bf16_programs_floats_alone():
    """cast_int32_to_int16 keeps its meaning: integers only."""
    model, ids = _llama()
    ep = fx16.cast_int32_to_int16(export(copy.deepcopy(model).to(BF16), ids))
    assert BF16 in _dtypes(ep) and FP16 not in _dtypes(ep)


class Bf16Branches(nn.Module):
    """A bf16 linear, then a cond whose branches compute on its result."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8).to(BF16)

    def forward(self, x):
        h = self.fc(x)
        return torch.cond(h.sum() > 0, lambda a: a * 2, lambda a: a.relu(), (h,))


def test_the_widening_reaches_into_a_conds_branches():
    """Input graph: linear (bf16) -> cond(branches on bf16). Output graph: fp16 outside
    and inside both branches, no bf16 left; the branches compute what they did."""
    torch.manual_seed(0)
    model, x = Bf16Branches().eval(), torch.randn(4, 8, dtype=BF16)
    ep = export(model, x)
    assert WidenOtherSixteenBitPass(Program.of(ep), BF16)(ep.graph_module).modified
    assert BF16 not in _dtypes(ep)
    check_program(ep)
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    assert BF16 not in _dtypes(ep) and FP16 in _dtypes(ep)
    with torch.no_grad():
        assert max_error([model(x).float()], run(ep, x)) < 2e-2


class TiedHead(nn.Module):
    """An embedding tied to the LM head, and a second pair of tied projections: every
    weight stored under two names, as trained language models ship."""

    def __init__(self, gain: float = 1.0) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight
        self.up, self.down = nn.Linear(16, 16), nn.Linear(16, 16)
        self.down.weight = self.up.weight
        with torch.no_grad():
            self.up.weight.mul_(gain)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.down(torch.relu(self.up(h))))


def _tied(ep) -> bool:
    state = ep.state_dict
    return state["embed.weight"] is state["head.weight"] and (
        state["up.weight"] is state["down.weight"]
    )


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_tied_weights_stay_one_tensor_through_the_widening(dtype):
    """Input: a bf16 (or fp32) program whose embedding and LM head share one tensor.
    Output: one fp16 tensor under both names, and as many weight bytes as the fp32
    program's cast (the widening copied each name apart: 2x the embedding)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    ep = fx16.cast_fp32_to_fp16(export(TiedHead().to(dtype).eval(), ids))
    assert _tied(ep) and ep.state_dict["embed.weight"].dtype == FP16
    fp32 = fx16.cast_fp32_to_fp16(export(TiedHead().eval(), ids))
    assert program_stats(ep).weight_bytes == program_stats(fp32).weight_bytes


@settings(max_examples=examples(10), deadline=None)
@given(
    st.sampled_from([FP32, BF16, FP16, "mixed"]),
    st.sampled_from([1.0, 3e4, 1e-6]),
    st.sampled_from(["fp16", "bf16"]),
)
def test_property_tied_state_shares_storage_after_any_cast(dtype, gain, low):
    """Tied weights in any dtype mix (fp32, bf16, fp16, bf16 embeddings beside fp32
    projections), at gains that fold a scale into them (3e4) or leave them below
    fp16's normal range (1e-6), cast to fp16 or bf16 (a program already in the target
    dtype is refused, leaving it as it was): every name still shares one tensor, and
    the program runs."""
    torch.manual_seed(0)
    model = TiedHead(gain).eval()
    if dtype == "mixed":
        model.embed.to(BF16)
    elif dtype != FP32:
        model.to(dtype)
    ids = torch.randint(0, 64, (2, 8))
    ep = export(model, ids)
    same = {"fp16": FP16, "bf16": BF16}[low] == dtype
    try:
        if low == "fp16":
            fx16.cast_fp32_to_fp16(ep)
        else:
            fx16.cast_to_16_bit_precision(ep, policy="auto_mixed_bf16", int16="off")
    except fx16.errors.InvalidProgramError:
        assert same  # nothing to cast: refused, the program as it was
    assert _tied(ep)
    run(ep, ids)


def test_an_autocast_region_the_model_wrote_keeps_its_dtypes():
    """Input: a bf16 program (its weights bf16) with a bf16 autocast region around a
    linear. Output, cast to fp16: the region's body computes in the dtype the region
    sets (bf16), as the model wrote it: the values joined to it are not widened."""
    from fx16.program.subgraphs import AUTOCAST

    torch.manual_seed(0)
    x = torch.randn(4, 8, dtype=BF16)
    ep = fx16.cast_fp32_to_fp16(export(AutocastRegions(BF16).to(BF16).eval(), x))
    check_program(ep)
    region = next(
        n
        for n in ep.graph_module.graph.find_nodes(op="call_function", target=AUTOCAST)
        if n.args[1] == BF16 and n.args[2]  # the enabled bf16 region
    )
    body = getattr(ep.graph_module, region.args[4].target)
    linears = [n for n in body.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert linears and all(node_val(n).dtype == BF16 for n in linears)
    assert ep.state_dict["inner.weight"].dtype == BF16


# steps whose rounding the model does itself (a no-op in a program made in that dtype;
# an autocast region, whose dtypes the region sets and whose inputs stay as the model
# made them), a write into the program's own input (widened, the program writes
# into the fp32 copy of the caller's bf16 input that fx16.inputs_for makes), and a write
# through ``h.float()`` (in the fp32 model ``h`` itself, which the write changes; in the
# bf16 model a copy, which it does not: the two models compute different functions)
OWN_ROUNDING = (
    *("to_bf16_and_back", "to_fp16_and_back", "autocast_bf16", "autocast_off"),
    *("write_into_source", "write_through_alias"),
)


def _runs_in_bf16(case) -> bool:
    """Whether the model runs in bf16 as made: a step of the menu that widens to fp32 by
    name (``(x.double() * c).float()``, an fp32 ``arange``) leaves a bf16 layer after it
    an fp32 input it refuses, in eager as in export."""
    try:
        with torch.no_grad():
            case.model(*case.args)
    except RuntimeError as error:
        if "type" not in str(error):
            raise
        return False
    return True


@settings(max_examples=examples(10), deadline=None)
@given(programs())
def test_property_a_bf16_program_widens_exactly_and_casts_within_the_bound(case):
    """Random programs from the fuzzer's menu, made in bf16 (weights, buffers and float
    inputs): the pass alone gives a program that lints and computes what the same
    weights compute in fp32 (the oracle's fp32 tolerance, or one rounding where the
    model's own cast back to bf16 is not joined to a bf16 weight); cast to fp16, the
    bf16 program lints, runs and holds the float oracle's bound against the widened
    one. The model's own rounding (``x.to(torch.bfloat16).to(x.dtype)``) is left out:
    in the bf16 program it is a no-op the widening keeps one, where the same code in
    the fp32 model rounds; so is a write into the program's own input (see
    ``OWN_ROUNDING``)."""
    assume(not any(step[0] in OWN_ROUNDING for step in case.model.steps))
    bf16 = dataclasses.replace(
        case,
        model=copy.deepcopy(case.model).to(BF16),
        args=tuple(a.to(BF16) if a.is_floating_point() else a for a in case.args),
    )
    assume(_runs_in_bf16(bf16))
    fp32 = dataclasses.replace(case, model=copy.deepcopy(bf16.model).float())
    with quiet():
        source, reference = bf16.export(), fp32.export()
    widened = copy.deepcopy(source)
    WidenOtherSixteenBitPass(Program.of(widened), BF16)(widened.graph_module)
    widened.graph_module.recompile()
    check_program(widened)
    check_cast_program(reference, widened, fp32.args)
    check_cast_program(widened, fx16.cast_fp32_to_fp16(copy.deepcopy(source)), fp32.args)


class PartlyBf16(nn.Module):
    """An fp32 linear (8x8 weight and bias) beside a bf16 table of ``rows`` x 8 it adds
    a row of: the table is bf16 by the model's choice."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(rows, 8).to(BF16))

    def forward(self, x):
        return self.fc(x) + self.table[0].float()


@pytest.mark.parametrize(("rows", "widened"), [(22, False), (40, True)])
def test_a_program_is_made_in_bf16_when_most_of_its_float_bytes_are(rows, widened):
    """Input bytes: the fp32 linear's 288 and the input's 64 against the bf16 table's 16
    per row. At 22 rows (352 bytes, half of all) the program is fp32 with a bf16
    table, which stays; at 40 (640 bytes, most) it was made in bf16 and is widened.
    Either way the pass hands back the module it was given."""
    torch.manual_seed(0)
    ep = export(PartlyBf16(rows).eval(), torch.randn(2, 8))
    result = WidenOtherSixteenBitPass(Program.of(ep), BF16)(ep.graph_module)
    assert result.modified is widened and result.graph_module is ep.graph_module
    assert (ep.state_dict["table"].dtype == torch.float32) is widened
