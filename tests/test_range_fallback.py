"""RangeFallbackPass (``range_fallback="bf16"``): what no power-of-two scale carries
computes in bf16 instead of fp32, with the cause kept in the report."""

import copy
import dataclasses
import json
import operator

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from fx16 import meta
from fx16.decisions import PRECISION, Reason
from fx16.passes import RangeFallbackPass
from fx16.passes.range_fallback import RANGE_REASONS
from fx16.passes.range_fallback import SAID as SAID_BF16
from fx16.plan.view import DOWNCASTABLE
from fx16.program.casts import cast_dtype, is_cast
from fx16.program.subgraphs import nested_graph_modules
from fx16.report import report_of
from fx16.testing import programs
from fx16.testing.checks import check_cast
from helpers import (
    assert_same_state,
    check_program,
    export,
    fp64_reference,
    max_error,
    run,
    run_fx16,
    state_snapshot,
)

BF16_EPS = torch.finfo(torch.bfloat16).eps
FP16 = torch.float16


class LoudAttention(nn.Module):
    """Self-attention whose logits reach ~3e5 (query and key weights x300): a softmax
    must read them unscaled, so no scale domain carries them through fp16."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, 4)
        with torch.no_grad():
            self.q.weight.mul_(300)
            self.k.weight.mul_(300)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.out(scores.softmax(-1) @ self.v(x)), scores


class WideWeight(nn.Module):
    """A product whose weight holds 1e6: beyond fp16, well inside bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        with torch.no_grad():
            self.weight[0, 0] = 1e6

    def forward(self, x):
        return torch.tanh(x @ self.weight * 1e-6)


def _attention():
    torch.manual_seed(0)
    return LoudAttention().eval(), torch.randn(2, 8, 16)


def _rows(ep) -> dict:
    return {row.node: row for row in report_of(ep).rows}


def _fp32_ops(ep) -> list[str]:
    """The ops (not casts) that compute an fp32 result."""
    return [
        node.name
        for node in ep.graph.nodes
        if node.op == "call_function"
        and not is_cast(node)
        and getattr(node.meta.get("val"), "dtype", None) == torch.float32
    ]


def test_logits_a_softmax_reads_unscaled_compute_in_bf16_with_their_cause():
    model, x = _attention()
    default = fx16.cast_fp32_to_fp16(export(model, x))
    fallback = fx16.cast_fp32_to_fp16(export(model, x), range_fallback="bf16")

    before, after = _rows(default)["matmul"], _rows(fallback)["matmul"]
    assert (before.dtype, before.rule) == ("float32", "activation_overflow")
    assert (after.dtype, after.rule) == ("bfloat16", "activation_overflow")
    assert "computed in bf16 (range_fallback='bf16')" in after.detail
    assert before.detail in after.detail  # the evidence stays: "observed 3.5e+05"
    assert _rows(fallback)["softmax"].dtype == "bfloat16"
    assert report_of(default).totals.flop_share_16bit < 1.0
    assert report_of(fallback).totals.flop_share_16bit == 1.0
    assert _fp32_ops(default) and not _fp32_ops(fallback)
    check_program(fallback)


def test_the_bf16_result_is_within_bf16_rounding_of_fp64_where_half_is_not_finite():
    model, x = _attention()
    reference = fp64_reference(model, x)
    got = run(fx16.cast_fp32_to_fp16(export(model, x), range_fallback="bf16"), x)
    assert all(torch.isfinite(value).all() for value in got)
    # the attention output reads logits rounded to 8 bits, the logits are one product
    assert max_error(reference[:1], got[:1]) <= 8 * BF16_EPS
    assert max_error(reference[1:], got[1:]) <= 4 * BF16_EPS
    half = copy.deepcopy(model).half()
    with torch.no_grad():
        assert not torch.isfinite(half(x.half())[0]).all()  # why it cannot be plain fp16


def test_outputs_keep_the_dtype_the_default_gives_them():
    model, x = _attention()
    default = fx16.cast_fp32_to_fp16(export(model, x))
    fallback = fx16.cast_fp32_to_fp16(export(model, x), range_fallback="bf16")
    assert [v.dtype for v in run(fallback, x)] == [v.dtype for v in run(default, x)]
    assert run(fallback, x)[1].dtype == torch.float32  # the bf16 logits, through a cast


def test_an_op_fp32_for_another_cause_reads_the_bf16_value_through_a_cast_to_fp32():
    model, x = _attention()
    policy = fx16.PrecisionPolicy.custom(fx16.PrecisionPolicy.default(), ops={"softmax": "fp32"})
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy, range_fallback="bf16")
    rows = _rows(ep)
    assert (rows["softmax"].dtype, rows["softmax"].rule) == ("float32", "policy")
    assert rows["matmul"].dtype == "bfloat16"
    (softmax,) = [n for n in ep.graph.nodes if n.name == "softmax"]
    read = softmax.args[0]
    assert is_cast(read) and cast_dtype(read) == torch.float32
    assert read.args[0].meta["val"].dtype == torch.bfloat16
    check_program(ep)


def test_a_weight_only_bf16_ops_read_is_stored_in_bf16():
    torch.manual_seed(0)
    model, x = WideWeight(), torch.randn(4, 8)
    policy = fx16.PrecisionPolicy.default(scale_range=False)  # the fp32 path, not a scale
    default = fx16.cast_fp32_to_fp16(export(model, x), policy=policy)
    fallback = fx16.cast_fp32_to_fp16(export(model, x), policy=policy, range_fallback="bf16")
    assert default.state_dict["weight"].dtype == torch.float32
    assert fallback.state_dict["weight"].dtype == torch.bfloat16
    row = _rows(fallback)["p_weight"]
    assert (row.dtype, row.rule) == ("bfloat16", "value_overflow")
    assert "stored in bf16" in row.detail
    assert report_of(fallback).totals.flop_share_16bit == 1.0
    (weight,) = [n for n in fallback.graph.nodes if n.name == "p_weight"]
    assert not any(is_cast(user) for user in weight.users)  # read as stored: no cast per call
    assert max_error(fp64_reference(model, x), run(fallback, x)) <= 4 * BF16_EPS
    check_program(fallback)


def test_casting_twice_equals_casting_once():
    model, x = _attention()
    once = fx16.cast_fp32_to_fp16(export(model, x), range_fallback="bf16")
    twice = fx16.cast_fp32_to_fp16(copy.deepcopy(once), range_fallback="bf16")
    assert twice.graph_module.code == once.graph_module.code
    assert {k: v.dtype for k, v in twice.state_dict.items()} == {
        k: v.dtype for k, v in once.state_dict.items()
    }


def test_the_pass_runs_only_where_asked_and_only_for_fp16():
    model, x = _attention()

    def has_pass(**options):
        return any(
            isinstance(p, RangeFallbackPass) for p in fx16.fp16_passes(export(model, x), **options)
        )

    assert not has_pass()
    assert has_pass(range_fallback="bf16")
    assert not has_pass(range_fallback="bf16", policy="auto_mixed_bf16")  # bf16 has the range


@pytest.mark.parametrize("bad", ["bfloat16", "fp16", 16])
def test_a_bad_range_fallback_is_refused_and_changes_nothing(bad):
    model, x = _attention()
    ep = export(model, x)
    before = state_snapshot(ep)
    with pytest.raises(fx16.InvalidOptionError, match="range_fallback must be one of"):
        fx16.cast_fp32_to_fp16(ep, range_fallback=bad)
    assert_same_state(before, state_snapshot(ep))


def test_the_command_line_takes_range_fallback(tmp_path):
    model, x = _attention()
    source, report = tmp_path / "attention.pt2", tmp_path / "report.json"
    torch.export.save(export(model, x), source)
    result = run_fx16(["cast", source, "--dry-run", "--range-fallback", "bf16", "--report", report])
    assert result.returncode == 0, result.stderr
    rows = {row["node"]: row for row in json.loads(report.read_text())["nodes"]}
    assert rows["matmul"]["dtype"] == "bfloat16"
    assert "computed in bf16" in rows["matmul"]["detail"]


def test_inspect_lists_what_the_fallback_moved_with_its_true_cause(tmp_path):
    """``fx16 inspect --range-fallback bf16`` (no ``--all``) lists the logits' product
    and the softmax, computed in bf16 for range; the softmax reads a bf16 input and says
    so (not "an input stays fp32")."""
    model, x = _attention()
    source = tmp_path / "attention.pt2"
    torch.export.save(export(model, x), source)
    result = run_fx16(["inspect", source, "--range-fallback", "bf16"])
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.strip()}
    assert "bfloat16" in listed["matmul"] and "activation_overflow" in listed["matmul"]
    assert "bf16_input" in listed["softmax"]
    assert "an input stays fp32" not in listed["softmax"]
    fallback = fx16.cast_fp32_to_fp16(export(model, x), range_fallback="bf16")
    assert {row.node for row in report_of(fallback).explained()} >= {"matmul", "softmax"}
    assert not report_of(
        fx16.cast_fp32_to_fp16(export(model, x), policy="auto_mixed_bf16")
    ).explained()


def test_the_doors_multiply_stays_fp32_under_the_fallback():
    """Input graph: raw units (~1e6, fp32) * 2**-k at the door -> linear ... With
    range_fallback="bf16" the door's multiply, exact in fp32 and reading an fp32 input
    kept for range, stays fp32: in bf16 it would round every input to 8 bits."""
    from benchmarks.range import RawUnits

    torch.manual_seed(0)
    model, x = RawUnits().eval(), torch.rand(8, 16) * 1e6
    ep = fx16.cast_fp32_to_fp16(export(model, x), range_fallback="bf16")
    check_program(ep)
    doors = [n for n in ep.graph.nodes if meta.range_scaled(n)]
    assert doors and all(n.meta["val"].dtype == torch.float32 for n in doors)
    assert max_error(fp64_reference(model, x), run(ep, x)) < 4 * 2.0**-11


class LoudIntoFp32Norm(nn.Module):
    """A linear whose outputs pass fp16's range (~1e5) read by an RMSNorm the model
    computes in fp32 itself (``x.float()``, then ``type_as``), then a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(64))
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        h = self.a(x)
        wide = h.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.b((normed * (1.0 + self.gain.float())).type_as(h))


def test_the_models_own_fp32_region_and_type_as_stay_fp32_under_the_fallback():
    """Input: linear (~1e5, kept fp32 for range with scale_range=False) -> the model's
    fp32 RMSNorm (pow, mean, add, rsqrt, mul: the region it opens, kept) -> type_as ->
    linear. With the fallback the linear computes in bf16; the region's ops stay fp32,
    as the default computes them (their squares are past fp16's range, a range cause,
    but the model asked for fp32 there), and so does ``type_as`` (a conversion to the
    linear's dtype: in bf16 it would round the norm's fp16 result to 8 bits)."""
    torch.manual_seed(0)
    model, x = LoudIntoFp32Norm().eval(), torch.randn(8, 64)
    policy = fx16.PrecisionPolicy.default(scale_range=False)
    default = fx16.cast_fp32_to_fp16(export(model, x), policy=policy)
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy, range_fallback="bf16")
    check_program(ep)
    rows = _rows(ep)
    assert rows["linear"].dtype == "bfloat16"
    region = ("pow_1", "mean", "add", "rsqrt", "mul", "type_as")
    assert {name: rows[name].dtype for name in region} == dict.fromkeys(region, "float32")
    assert {name: _rows(default)[name].dtype for name in region} == dict.fromkeys(region, "float32")
    reference = fp64_reference(model, x)
    # bf16's rounding of the linear alone (2**-9 a value, through the norm), not more
    assert max_error(reference, run(ep, x)) < 4 * 2.0**-8


def test_a_returned_elementwise_op_keeps_the_answer_in_fp32_under_the_fallback():
    """Input graph: x @ gain (1e-9) -> reciprocal (~1e9, at a scale) -> the multiply that
    undoes it, returned. Output with the fallback: the multiply stays fp32 as in the
    default (in bf16 the answer would keep 8 bits: 1.18x the default's error); the
    fallback is never worse than the default here."""
    from benchmarks.range import TinyWeights

    torch.manual_seed(0)
    model, x = TinyWeights().eval(), torch.randn(4, 32)
    default = fx16.cast_fp32_to_fp16(export(model, x))
    fallback = fx16.cast_fp32_to_fp16(export(model, x), range_fallback="bf16")
    assert _rows(fallback)["mul_1"].dtype == _rows(default)["mul_1"].dtype == "float32"
    reference = fp64_reference(model, x)
    assert max_error(reference, run(fallback, x)) <= max_error(reference, run(default, x))


class RangeBesideAutocastOff(nn.Module):
    """A value past fp16's range (``a``, 1e6x a linear) read by an op whose result
    fits (``tanh``) and, with the model's own fp32 value (an ``autocast(enabled=False)``
    region's), by a division whose result fits."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        a = self.lin(x) * 1e6
        with torch.autocast("cpu", enabled=False):
            k = torch.exp(x) * 3.0
        return self.out(k / a), torch.tanh(a)


def test_an_op_reading_the_models_own_fp32_beside_a_range_value_stays_fp32():
    """Input: ``a`` (range) read by ``tanh`` and, with the autocast-off region's ``k``,
    by ``k / a``; both are fp32 only for reading an fp32 value (``fp32_input``). Output
    with the fallback: ``a`` and ``tanh`` compute in bf16 (``tanh``: ``bf16_input``);
    the division still computes in fp32, reading ``k`` as the model made it and ``a``
    through a cast back to fp32 (in bf16 it would round the model's fp32 value)."""
    torch.manual_seed(0)
    model, x = RangeBesideAutocastOff().eval(), torch.randn(4, 8)
    policy = fx16.PrecisionPolicy.default(scale_range=False)  # the fp32 path, not a scale
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy, range_fallback="bf16")
    check_program(ep)
    rows = _rows(ep)
    assert (rows["mul"].dtype, rows["mul"].rule) == ("bfloat16", "activation_overflow")
    assert (rows["tanh"].dtype, rows["tanh"].rule) == ("bfloat16", "bf16_input")
    assert (rows["div"].dtype, rows["div"].rule) == ("float32", "fp32_input")
    (div,) = [n for n in ep.graph.nodes if n.name == "div"]
    region_value, range_value = div.args
    assert region_value.meta["val"].dtype == torch.float32 and not is_cast(region_value)
    assert is_cast(range_value) and range_value.args[0].meta["val"].dtype == torch.bfloat16
    reference = fp64_reference(model, x)
    assert max_error(reference, run(ep, x)) <= 4 * BF16_EPS


def _bf16_in_bodies(ep) -> list[str]:
    """The ops computing bf16 inside the program's bodies (the model's own bf16 regions)."""
    return sorted(
        node.name
        for module in nested_graph_modules(ep.graph_module)[1:]
        for node in module.graph.nodes
        if node.op == "call_function"
        and getattr(node.meta.get("val"), "dtype", None) is torch.bfloat16
    )


def _assert_reads_what_bf16_may_read(node) -> None:
    """``node`` (moved to bf16 for reading a bf16 value) reads, through its casts, only
    bf16 or fp16 values and fp32 values kept for range or for a precision a 16-bit op
    may give up: never the model's own fp32."""
    for arg in node.all_input_nodes:
        while is_cast(arg):
            arg = arg.args[0]
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
            continue
        made = arg.meta.get(PRECISION)
        assert made is not None and made.reason in RANGE_REASONS | DOWNCASTABLE, (
            node.name,
            arg.name,
            made,
        )


def _ops_by_dtype(ep) -> dict[str, torch.dtype]:
    """Each top-level op (not a cast) of ``ep`` and the float dtype it computes."""
    return {
        node.name: node.meta["val"].dtype
        for node in ep.graph.nodes
        if node.op == "call_function"
        and not is_cast(node)
        and isinstance(node.meta.get("val"), torch.Tensor)
        and node.meta["val"].is_floating_point()
    }


@settings(max_examples=examples(12), deadline=None)
@given(programs(), st.sampled_from([1.0, 1e3, 1e5]), st.booleans())
def test_property_the_fallback_moves_only_what_range_kept_fp32(case, input_scale, scale_range):
    """Random programs from the fuzzer's menu, their inputs scaled past fp16's range,
    cast with and without ``range_fallback="bf16"`` (scale domains on and off): the
    fallback's program lints, runs and holds the float oracle's bound; every op it
    turns bf16 (not one of the model's own bf16 regions) was fp32 in the default cast
    and keeps a range cause (or reads a bf16 value: ``bf16_input``); every op the
    default computes in fp16 stays fp16; no op in a body turns bf16 (the model's own
    bf16 regions stay); the outputs keep the default's dtypes. An op moved for reading
    a bf16 value reads no fp32 value the model kept for itself."""
    args = tuple(a * input_scale if a.is_floating_point() else a for a in case.args)
    case = dataclasses.replace(case, args=args)
    policy = fx16.PrecisionPolicy.default(scale_range=scale_range)
    default = check_cast(case, lambda ep: fx16.cast_fp32_to_fp16(ep, policy=policy))
    fallback = check_cast(
        case, lambda ep: fx16.cast_fp32_to_fp16(ep, policy=policy, range_fallback="bf16")
    )
    before, after = _ops_by_dtype(default), _ops_by_dtype(fallback)
    allowed = RANGE_REASONS | {Reason.BF16_INPUT}
    for node in fallback.graph.nodes:
        if after.get(node.name) is torch.bfloat16 and before.get(node.name) is not torch.bfloat16:
            assert before.get(node.name) is torch.float32, node.name
            assert node.meta[PRECISION].reason in allowed, (node.name, node.meta[PRECISION])
            if node.meta[PRECISION].reason is Reason.BF16_INPUT:
                _assert_reads_what_bf16_may_read(node)
    assert all(after.get(name) is torch.float16 for name, d in before.items() if d is FP16)
    assert _bf16_in_bodies(fallback) == _bf16_in_bodies(default)
    with torch.no_grad():
        assert [v.dtype for v in run(fallback, *args)] == [v.dtype for v in run(default, *args)]


def test_the_pass_alone_says_whether_it_changed_the_program_and_commits_its_state():
    """RangeFallbackPass run by itself on a program cast with the fp32 path: it moves
    the product, reports ``modified`` and hands back the module it was given, and (its
    program not deferring state) stores the weight bf16 at once, as the decision says;
    run again it finds nothing to move and says so. The casts it adds say why they
    are there (an upcast for a wide op)."""
    from fx16.program import Program
    from fx16.program.casts import INSERTED, WHY_UPCAST

    torch.manual_seed(0)
    model, x = WideWeight(), torch.randn(4, 8)
    policy = fx16.PrecisionPolicy.default(scale_range=False)
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy)
    before = {n.name for n in ep.graph.nodes if is_cast(n)}
    result = RangeFallbackPass(Program.of(ep))(ep.graph_module)
    assert result.modified is True and result.graph_module is ep.graph_module
    ep.graph_module.recompile()
    assert ep.state_dict["weight"].dtype == torch.bfloat16
    added = [n for n in ep.graph.nodes if is_cast(n) and n.name not in before]
    assert added and all(n.meta[INSERTED] == WHY_UPCAST for n in added)
    assert _rows(ep)["matmul"].detail.endswith(SAID_BF16)
    check_program(ep)
    assert max_error(fp64_reference(model, x), run(ep, x)) <= 4 * BF16_EPS
    again = RangeFallbackPass(Program.of(ep))(ep.graph_module)
    assert again.modified is False and again.graph_module is ep.graph_module


class SharedWideWeight(WideWeight):
    """WideWeight's weight read by its product (fp32 for range: the fallback's) and by
    ``sin`` (fp32 by the caller's policy)."""

    def forward(self, x):
        return super().forward(x), torch.sin(self.weight * 1e-6).sum()


def test_a_weight_an_fp32_op_also_reads_stays_fp32():
    """The product computes in bf16 and reads the weight through a cast; ``sin``, fp32
    for the caller, reads the fp32 weight as stored: the weight is not stored in bf16."""
    torch.manual_seed(0)
    model, x = SharedWideWeight(), torch.randn(4, 8)
    policy = fx16.PrecisionPolicy.custom(
        fx16.PrecisionPolicy.default(scale_range=False), ops={"sin": "fp32", "mul": "fp32"}
    )
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy, range_fallback="bf16")
    check_program(ep)
    assert ep.state_dict["weight"].dtype == torch.float32
    assert _rows(ep)["matmul"].dtype == "bfloat16"
    assert max_error(fp64_reference(model, x), run(ep, x)) <= 4 * BF16_EPS


def test_a_conds_result_past_the_range_stays_as_its_body_returns_it():
    """A cond whose branch returns 1e5x its input (fp32 for range) and an add reading
    its result: the add computes in bf16 through a cast; the getitem of the cond's
    result stays the dtype its body returns (fp32), and the program lints and runs."""
    from models import Branches

    torch.manual_seed(0)
    model = Branches().eval()
    x = -torch.rand(2, 4) - 4  # the negative branch: 1e5x
    with torch.no_grad():
        model.fc.weight.abs_()
    policy = fx16.PrecisionPolicy.default(scale_range=False)
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy, range_fallback="bf16")
    check_program(ep)
    getitems = [n for n in ep.graph.nodes if n.target is operator.getitem]
    assert getitems and all(n.meta["val"].dtype == torch.float32 for n in getitems)
    assert max_error(fp64_reference(model, x), run(ep, x)) <= 4 * BF16_EPS


class NearFp32sLargest(nn.Module):
    """A value near fp32's largest (0/1 ids times -3.4e38, the fill some models use)
    scaled back down: past fp16's range and past bf16's (3.39e38) too."""

    def forward(self, x, ids):
        return x + (ids.float() * -3.4e38) * 1e-30


def test_a_value_past_bf16s_largest_stays_fp32():
    """The product of ids and -3.4e38 is kept fp32 for range; in bf16 it would round to
    -inf. The fallback leaves it, and what reads it, in fp32: the output is finite."""
    torch.manual_seed(0)
    model, x, ids = NearFp32sLargest().eval(), torch.randn(3, 4), torch.randint(0, 2, (3, 4))
    policy = fx16.PrecisionPolicy.default(scale_range=False)
    ep = fx16.cast_fp32_to_fp16(export(model, x, ids), policy=policy, range_fallback="bf16")
    check_program(ep)
    (product,) = [n for n in ep.graph.nodes if n.name == "mul"]
    assert product.meta["val"].dtype == torch.float32
    (out,) = run(ep, x, ids)
    assert bool(torch.isfinite(out).all())
    with torch.no_grad():
        assert max_error([model(x, ids)], [out]) < 1e-2


def test_a_range_op_that_also_feeds_an_ill_conditioned_one_stays_fp32():
    """Found by the long fuzz: readings of ~1e5, ``x + log_softmax(x)`` (past fp16's
    range) written back and subtracted from x, then an exp. The sum is fp32 for range,
    and it also feeds the exp through a cancellation: in bf16 its rounding (~512 at
    2e5) reached the exp as e**500, inf where fp32 gives 0. It stays fp32."""
    from fx16.testing.random_programs import RandomProgram

    torch.manual_seed(0)
    steps = [
        ("log_softmax", 0, 0, 1e-9),
        ("write_into_source", 0, 3, 1e-9),
        ("abs", 0, 0, 1e-9),
        ("exp", 14, 0, 1e-9),
    ]
    model = RandomProgram(2, steps, []).eval()
    x = torch.tensor([[0.6577, 0.9387], [1.1317, -0.6455], [-1.7703, 0.2143]]) * 1e5
    ids = torch.tensor([[9, 10], [10, 15], [8, 1]])
    ep = torch.export.export(model, (x, ids)).run_decompositions()
    policy = fx16.PrecisionPolicy.default(scale_range=False)
    fx16.cast_fp32_to_fp16(ep, policy=policy, range_fallback="bf16")
    (add,) = ep.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)[:1]
    assert meta.ill_conditioned(add) and add.meta["val"].dtype == torch.float32
    with torch.no_grad():
        want, got = model(x, ids)[3], ep.module()(x, ids)[3]
    assert torch.equal(torch.isinf(got), torch.isinf(want))
