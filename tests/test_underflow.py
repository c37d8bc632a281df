"""UnderflowAnalysis: values that flush to zero in 16-bit where an op is singular at zero.

Unseen inputs differ from the calibration inputs: sharper logits, rows of zeros.
"""

import copy

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from benchmarks.precision_zoo import (
    Entropy,
    KLDivergence,
    NegativeLogLikelihood,
    Normalized,
    RMSNormEps,
)
from fx16.analysis import CalibrationAnalysis, UnderflowAnalysis, ValueRangeAnalysis
from fx16.decisions import PRECISION, Reason
from fx16.program import Program
from helpers import check_program, export, fp64_reference, max_error, run

KEY = UnderflowAnalysis.META_KEY


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def _analyse(ep, calibration=None):
    program = Program(ep)
    CalibrationAnalysis(program, calibration)(ep.graph_module)
    ValueRangeAnalysis(program)(ep.graph_module)
    assert not UnderflowAnalysis(program)(ep.graph_module).modified
    return {node.name: node.meta.get(KEY) for node in ep.graph_module.graph.nodes}


def _error_and_nonfinite(model, ep, *args):
    """(max |fx16 - fp64| / max |fp64|, how many outputs are not finite where fp64 is)."""
    want = fp64_reference(model, *args)[0]
    got = run(ep, *args)[0].double()
    bad = int((~torch.isfinite(got) & torch.isfinite(want)).sum())
    finite = torch.isfinite(got)
    error = float((want - got)[finite].abs().max() / want.abs().max()) if finite.any() else 1.0
    return error, bad


def _half(model, *args):
    half = copy.deepcopy(model).half()
    with torch.no_grad():
        return half(*[a.half() if a.is_floating_point() else a for a in args]).double()


def test_the_log_of_a_sharp_softmax_is_kept_with_the_softmax_not_the_head():
    """head (linear) -> softmax -> log -> mul -> sum: the log and the softmax are marked,
    the head is read as computed in fp16."""
    torch.manual_seed(0)
    marks = _analyse(export(Entropy(), torch.randn(16, 32, generator=_generator(1))))
    assert "singular at zero" in marks["log"] and "reaches" in marks["log"]
    assert marks["softmax"] == "feeds log, kept in fp32"
    assert marks["linear"] is None and marks["mul"] is None and marks["sum_1"] is None


def test_a_mild_softmax_is_left_alone():
    torch.manual_seed(0)
    marks = _analyse(export(Entropy(sharpness=0.05), torch.randn(16, 32)))
    assert marks["log"] is None and marks["softmax"] is None


class Divide(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x, y):
        return x / (y.abs() * self.scale + self.scale)


def test_a_divisor_in_the_subnormal_range_keeps_the_division():
    """x / (|y| * 1e-6 + 1e-6): the divisor lies in [1e-6, 5e-6], fp16's subnormals."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    marks = _analyse(export(Divide(1e-6), x, y))
    assert "singular at zero" in marks["div"]
    assert marks["add"] and marks["mul"] and marks["abs_1"] and marks["y"]
    assert marks["x"] is None  # the numerator is no business of this rule
    assert _analyse(export(Divide(1e-2), x, y))["div"] is None


class Powers(nn.Module):
    def forward(self, x):
        return (x * 1e-5).pow(-0.5) + (x * 1e-5).pow(2.0)


def test_a_negative_power_is_singular_a_positive_one_is_not():
    marks = _analyse(export(Powers(), torch.rand(4, 8) + 0.5))
    assert "singular at zero" in marks["pow_1"]
    assert marks["pow_2"] is None


class ScalarDivisor(nn.Module):
    def forward(self, x):
        return x / 1e-9


def test_a_scalar_divisor_below_the_smallest_subnormal_is_judged_like_a_value():
    marks = _analyse(export(ScalarDivisor(), torch.randn(4, 8)), calibration=[])
    assert "1e-09 reaches 1e-09 (a scalar)" in marks["div"]


class ProvenTiny(nn.Module):
    def forward(self, x):
        tiny = torch.arange(1, 9).float() * 1e-6  # proven in [1e-6, 8e-6]
        return x / tiny


def test_a_proven_range_counts_without_calibration():
    marks = _analyse(export(ProvenTiny(), torch.randn(4, 8)), calibration=[])
    assert "(proven)" in marks["div"]


CASES = {
    "entropy": (Entropy, 1),
    "kl": (KLDivergence, 1),
    "nll": (NegativeLogLikelihood, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_log_of_probabilities_is_finite_and_accurate_on_sharper_unseen_logits(case):
    """Calibrated on x, run on 1.5x: eager .half() gives nan or inf, fx16 within 3e-3."""
    build, inputs = CASES[case]
    torch.manual_seed(0)
    model = build().eval()
    example = [torch.randn(16, 32, generator=_generator(1))]
    unseen = [torch.randn(16, 32, generator=_generator(2)) * 1.5]
    if inputs == 2:
        example.append(torch.randint(0, 256, (16,), generator=_generator(1)))
        unseen.append(torch.randint(0, 256, (16,), generator=_generator(2)))
    ep = fx16.cast_fp32_to_fp16(export(model, *example))
    check_program(ep)
    error, bad = _error_and_nonfinite(model, ep, *unseen)
    assert bad == 0 and error < 3e-3
    assert not torch.isfinite(_half(model, *unseen)).all()  # what the rule prevents
    rows = {row.node: row for row in fx16.report.report_of(ep).rows}
    assert rows["log"].rule == "underflow" and rows["log"].dtype == "float32"
    assert all(row.dtype == "float16" for row in rows.values() if row.product)


@pytest.mark.parametrize(
    "build", [lambda: Normalized(), lambda: Normalized(by_hand=True), lambda: RMSNormEps()]
)
def test_an_eps_of_1e_12_is_clamped_with_a_recorded_reason_and_zero_rows_stay_finite(build):
    """eps 1e-12 flushes to 0 in fp16 (eager .half(): 0 / 0 on a row of zeros); fx16
    clamps it to the smallest subnormal and records why."""
    torch.manual_seed(0)
    model = build().eval()
    ep = fx16.cast_fp32_to_fp16(export(model, torch.randn(16, 32, generator=_generator(1))))
    check_program(ep)
    unseen = torch.randn(16, 32, generator=_generator(2))
    unseen[:3] = 0  # rows of zeros
    error, bad = _error_and_nonfinite(model, ep, unseen)
    assert bad == 0 and error < 3e-3
    assert not torch.isfinite(_half(model, unseen)).all()
    clamped = [row for row in fx16.report.report_of(ep).rows if row.rule == "scalar_clamped"]
    assert len(clamped) == 1 and "1e-12 -> 5.96e-08" in clamped[0].detail


def test_when_zero_rows_are_calibrated_the_guarded_op_stays_fp32_with_its_eps():
    """A calibration input with a row of zeros shows mean(x^2) + 1e-12 at 1e-12: the
    add (its eps kept at 1e-12), the mean and the squares stay fp32 for the rsqrt,
    which stays fp32 too (its 1e6 overflows fp16 first)."""
    torch.manual_seed(0)
    model = RMSNormEps().eval()
    example = torch.randn(4, 32)
    example[0] = 0
    ep = fx16.cast_fp32_to_fp16(export(model, example))
    nodes = {node.name: node for node in ep.graph_module.graph.nodes}
    for name in ("add", "mean", "pow_1"):
        assert nodes[name].meta[PRECISION].reason == Reason.UNDERFLOW
    assert nodes["rsqrt"].meta[PRECISION].reason == Reason.ACTIVATION_OVERFLOW
    assert nodes["add"].args[1] == 1e-12
    assert max_error(fp64_reference(model, example), run(ep, example)) < 3e-3


@settings(max_examples=examples(12), deadline=None)
@given(st.floats(0.5, 6.0), st.floats(1.0, 1.5), st.integers(0, 2**16))
def test_property_entropy_is_finite_where_fp64_is(sharpness, unseen_scale, seed):
    """Any sharpness up to a trained LM's (tails far below 6e-8), calibrated on one input
    and run on a sharper one: no inf or nan where fp64 has none, within 3e-3 of it.
    (Logits sharper still are rounded by more than that as the head computes them,
    in 16-bit.)"""
    torch.manual_seed(seed)
    model = Entropy(sharpness=sharpness).eval()
    ep = fx16.cast_fp32_to_fp16(export(model, torch.randn(8, 32, generator=_generator(seed))))
    unseen = torch.randn(8, 32, generator=_generator(seed + 1)) * unseen_scale
    error, bad = _error_and_nonfinite(model, ep, unseen)
    assert bad == 0 and error < 3e-3
