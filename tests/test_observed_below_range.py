"""ObservedBelowRangeRule over random programs: no value calibration saw wholly below
fp16's normal range is computed in fp16 as it is. Without scale domains it computes in
fp32; with them (the default) it may compute in fp16 only carried at a power of two
that lifts it into the normal range. The single-model tests are in test_fp32_rules.py."""

import dataclasses

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from fx16 import meta
from fx16.analysis.safety_rules.range import TENSOR_SUMS
from fx16.decisions import Reason, decision_of
from fx16.ops.numerics import interval_below_normal
from fx16.policy import PrecisionPolicy
from fx16.program.casts import is_cast, is_inserted
from fx16.testing import programs
from fx16.testing.checks import check_cast
from helpers import check_program, export, fp64_reference, max_error, run

FP16 = torch.float16
TINY = torch.finfo(FP16).tiny
NOT_WORTH = Reason.NOT_WORTH_FP32


def _in_normal_range(node) -> bool:
    largest = meta.observed_max_abs(node)
    return bool(largest) and not interval_below_normal((-largest, largest), FP16)


def _below_range(node) -> float | None:
    """The largest magnitude calibration saw ``node`` hold, where it is nonzero and
    below fp16's smallest normal and nothing excuses it (a stable rewrite's harmless
    term, sums that reach the normal range reading it)."""
    largest = meta.observed_max_abs(node)
    if not largest or _in_normal_range(node) or meta.negligible(node):
        return None
    if meta.rounding_cancels(node):
        return None
    readers = list(_readers(node))
    absorbed = readers and all(u.target in TENSOR_SUMS and _in_normal_range(u) for u in readers)
    return None if absorbed else largest


def _sixteen_bit_ops(ep) -> set[str]:
    """The ops ``ep`` computes in a 16-bit dtype as exported (the model's own)."""
    return {
        node.name
        for node in ep.graph.nodes
        if node.op == "call_function"
        and isinstance(val := node.meta.get("val"), torch.Tensor)
        and val.dtype in (torch.float16, torch.bfloat16)
    }


def _readers(node):
    """What reads ``node``'s value, through the casts fx16 inserted (the rule judged
    the program before them)."""
    for user in node.users:
        if is_cast(user) and is_inserted(user):
            yield from _readers(user)
        else:
            yield user


@settings(max_examples=examples(12), deadline=None)
@given(programs(), st.sampled_from([1e-5, 1e-7]), st.booleans())
def test_property_no_value_below_the_normal_range_computes_in_fp16_unlifted(
    case, input_scale, scale_range
):
    """Random programs from the fuzzer's menu on inputs scaled down into fp16's
    subnormals: the cast lints, runs and holds the float oracle's bound; each op whose
    calibrated values lie below the normal range computes in fp32 or (scale domains
    on) in fp16 at a scale 2**e that lifts its largest value to the normal range, or
    the verdict check measured fp32 no better there (``not_worth_fp32``: a value the
    program returns in fp16, whose output rounding loses it either way), or the model
    computes it in 16-bit itself (``h = x.half(); h.mul_(0.5)``: its own choice)."""
    args = tuple(a * input_scale if a.is_floating_point() else a for a in case.args)
    case = dataclasses.replace(case, args=args, input_scale=case.input_scale * input_scale)
    policy = PrecisionPolicy.default(scale_range=scale_range)
    ep = check_cast(case, lambda ep: fx16.cast_fp32_to_fp16(ep, policy=policy))
    own = _sixteen_bit_ops(case.export())
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or is_cast(node) or not isinstance(val, torch.Tensor):
            continue
        if node.name in own:
            continue
        largest = _below_range(node)
        if largest is None or val.dtype != FP16 or decision_of(node).reason is NOT_WORTH:
            continue  # the verdict check measured fp32 no better: a value returned in fp16
        exponent = meta.scale_exponent(node)
        assert scale_range and largest * 2.0**exponent >= TINY, (node.name, largest, exponent)


class TinyAddend(nn.Module):
    """A value below fp16's normal range (``lin(x) * 1e-7``) read by a sum that reaches
    the normal range (``x + t``), by a sum that stays below it (``t + t``) or by
    a product (``t * 1e4``), as ``reader`` says."""

    def __init__(self, reader: str) -> None:
        super().__init__()
        self.lin, self.reader = nn.Linear(8, 8), reader

    def forward(self, x):
        tiny = self.lin(x) * 1e-7
        if self.reader == "normal sum":
            return x + tiny
        if self.reader == "tiny sum":
            return tiny + tiny
        return tiny * 1e4


@pytest.mark.parametrize(
    ("reader", "kept"), [("normal sum", False), ("tiny sum", True), ("product", True)]
)
def test_a_value_below_the_range_is_kept_unless_a_sum_in_range_absorbs_it(reader, kept):
    """Without scale domains: the tiny value computes in fp32 unless every reader adds it
    to a tensor and reaches the normal range (its subnormal rounding, at most half the
    smallest subnormal, is below the sum's); a sum that stays below the range, or a
    product that scales it back up, reads it fp32."""
    torch.manual_seed(0)
    model, x = TinyAddend(reader).eval(), torch.randn(4, 8)
    policy = PrecisionPolicy.default(scale_range=False)
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy)
    check_program(ep)
    made = decision_of(next(n for n in ep.graph.nodes if n.name == "mul"))
    assert (made.reason is Reason.ACTIVATION_BELOW_RANGE) is kept, made
    assert (made.dtype == torch.float32) is kept
    assert max_error(fp64_reference(model, x), run(ep, x)) < 4 * 2.0**-11


@pytest.mark.parametrize(
    ("said", "kept"),
    [({}, True), ({meta.NEGLIGIBLE: "why"}, False), ({meta.ROUNDING_CANCELS: "why"}, False)],
)
def test_a_stable_rewrites_harmless_term_below_the_range_is_not_kept(said, kept):
    """A node observed at most 1e-6 (below fp16's normal range), read by a product: the
    rule keeps it fp32, unless a stable rewrite proved its loss harmless (an eps term
    flushing to zero loses nothing: ``negligible``; a power-of-two scale whose
    rounding cancels: ``rounding_cancels``)."""
    from fx16.analysis.safety_rule import RuleContext
    from fx16.analysis.safety_rules.range import ObservedBelowRangeRule

    graph = torch.fx.Graph()
    node = graph.call_function(torch.ops.aten.mul.Tensor, (1.0, 2.0))
    graph.call_function(torch.ops.aten.mul.Tensor, (node, 1e6))
    node.meta.update({"val": torch.zeros(2), meta.OBSERVED_MAX_ABS: 1e-6, **said})
    found = ObservedBelowRangeRule(FP16).applies(node, RuleContext(None, None))
    assert (found is not None) is kept, found


class TinyBatchNorm(nn.Module):
    """A BatchNorm whose running variance was fitted to inputs of ~1e5 (1e10), read on
    inputs of ~1: its outputs (~1e-5) lie below fp16's normal range, its input and
    weights do not; then a scale back up. Exported decomposed, the norm is one op with
    three results."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        with torch.no_grad():
            self.norm.running_var.fill_(1e10)
            self.norm.bias.zero_()

    def forward(self, x):
        return self.norm(x.abs()) * 1e5


def test_an_op_with_several_results_is_judged_by_the_result_read():
    """The decomposed norm's first result holds at most ~3e-5: the op computes in fp32,
    its reason naming the result (the tuple's largest magnitude, its statistics', once
    hid it: the result computed in fp16, subnormal)."""
    torch.manual_seed(0)
    model, x = TinyBatchNorm().eval(), torch.randn(8, 4)
    ep = fx16.cast_fp32_to_fp16(export(model, x, decompose=True))
    check_program(ep)
    (norm,) = [n for n in ep.graph.nodes if "batch_norm" in str(n.target)]
    made = decision_of(norm)
    assert made.dtype == torch.float32 and made.reason == Reason.ACTIVATION_BELOW_RANGE
    assert made.detail.startswith("getitem observed at most")
    assert max_error(fp64_reference(model, x), run(ep, x)) < 8 * 2.0**-11


class NormOfACube(nn.Module):
    """A layer norm of ``x ** 3`` on inputs of about 1e-2: the cube (about 1e-6) lies
    below fp16's normal range."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(2)

    def forward(self, x):
        return self.norm(x**3)


def test_a_value_kept_fp32_for_precision_below_the_range_is_read_in_fp32():
    """The cube is kept fp32 for its conditioning (a reason that lets a 16-bit reader
    take a 16-bit copy of a value that fits): a copy of it would be subnormal, so the
    norm reads it in fp32 and holds fp32's accuracy (it read 1-bit subnormals before)."""
    torch.manual_seed(0)
    model, x = NormOfACube().eval(), 0.01 * torch.randn(3, 2)
    assert 0 < float((x**3).abs().max()) < 2.0**-14
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    (cube,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.pow.Tensor_Scalar]
    (norm,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.layer_norm.default]
    assert decision_of(cube).dtype == torch.float32
    assert norm.args[0] is cube and decision_of(norm).dtype == torch.float32
    assert decision_of(norm).detail == "from pow_1: ill_conditioned, below the 16-bit normal range"
    assert max_error(fp64_reference(model, x), run(ep, x)) < 4 * 2.0**-11
