"""UnderflowAnalysis: values that flush to zero in 16-bit where an op is singular at zero.

Unseen inputs differ from the calibration inputs: sharper logits, rows of zeros.
"""

import copy
import math

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
from benchmarks.shift_traps import FrameRmsNorm, TailEntropy, audio_frames
from fx16.analysis import CalibrationAnalysis, UnderflowAnalysis, ValueRangeAnalysis
from fx16.analysis.underflow import small_end
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
        tiny = x * 1e-5
        return tiny.pow(-0.5) + tiny.pow(2.0) + tiny.pow(0.5) + tiny.pow(0)


def test_a_negative_power_is_singular_a_positive_one_is_not():
    """x ** -0.5 of a tiny x is singular; x ** 2, x ** 0.5 and x ** 0 are not (a
    fractional power is finite at zero, the zeroth is 1)."""
    marks = _analyse(export(Powers(), torch.rand(4, 8) + 0.5))
    assert "singular at zero" in marks["pow_1"]
    assert marks["pow_2"] is None and marks["pow_3"] is None and marks["pow_4"] is None


class ExactlyAtTheMargin(nn.Module):
    def forward(self, x, y):
        return x / (y * 0 + 2.0**-13)


def test_a_divisor_at_exactly_twice_the_smallest_normal_is_left_16_bit():
    """2**-13 is fp16's smallest normal times the margin: the least a value may be."""
    marks = _analyse(export(ExactlyAtTheMargin(), torch.randn(4, 8), torch.randn(4, 8)))
    assert marks["div"] is None


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


class RangedDivisor(nn.Module):
    """``x / (arange(low, high) * 1e-6)``, its zero replaced by ``fill``: a divisor whose
    proven interval holds zero (the replacement widens it to ``fill``'s side)."""

    def __init__(self, low: int, high: int, sign: float, fill: float):
        super().__init__()
        self.low, self.high, self.sign, self.fill = low, high, sign, fill

    def forward(self, x):
        divisor = torch.arange(self.low, self.high).float() * (self.sign * 1e-6)
        return x / (divisor + self.fill * (divisor == 0).float())


@pytest.mark.parametrize(
    ("low", "high", "sign", "fill"),
    [(0, 8, 1.0, 1.0), (0, 8, -1.0, -1.0), (-4, 4, 1.0, -1.0)],
    ids=["from_zero_up", "from_zero_down", "around_zero"],
)
def test_an_interval_that_holds_zero_proves_nothing_and_calibration_judges(low, high, sign, fill):
    """Proven intervals that end at zero ([0, 1], [-1, 0]) or hold it with a small end
    ([-1, 3e-6]) bound nothing away from zero: the smallest magnitude calibration saw
    (1e-6) keeps the division."""
    marks = _analyse(export(RangedDivisor(low, high, sign, fill), torch.randn(4, 8)))
    assert "(observed)" in marks["div"] and "reaches 1e-06" in marks["div"]


# model -> (inputs, the remedy: fp32 by the underflow rule, or the stable rewrite where
# the softmax has no other reader)
CASES = {
    "entropy": (Entropy, 1, "underflow"),
    "kl": (KLDivergence, 1, "underflow"),
    "nll": (NegativeLogLikelihood, 2, "log_softmax"),
}


@pytest.mark.parametrize("case", CASES)
def test_log_of_probabilities_is_finite_and_accurate_on_sharper_unseen_logits(case):
    """Calibrated on x, run on 1.5x: eager .half() gives nan or inf, fx16 within 3e-3."""
    build, inputs, remedy = CASES[case]
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
    if remedy == "underflow":
        assert rows["log"].rule == "underflow" and rows["log"].dtype == "float32"
    else:
        assert [row.stabilized for row in rows.values() if row.stabilized] == [remedy]
    assert all(row.dtype == "float16" for row in rows.values() if row.product)


# model -> how fx16 holds a row of zeros: the norm kept fp32 (a mean or sum of squares,
# guarded by an eps below 16-bit's normal range, has no lower bound), or the RMSNorm
# rewritten with its squares scaled into range
GUARDED_NORMS = {
    "F.normalize": (lambda: Normalized(), "underflow"),
    "x / (norm + eps)": (lambda: Normalized(by_hand=True), "underflow"),
    "rsqrt(mean(x^2) + eps)": (lambda: RMSNormEps(), "rms_norm_scaling"),
}


@pytest.mark.parametrize("case", GUARDED_NORMS)
def test_a_norm_guarded_by_an_eps_of_1e_12_holds_rows_of_zeros_and_quiet_rows(case):
    """eps 1e-12 flushes to 0 in fp16 (eager .half(): 0 / 0 on a row of zeros), and a
    quiet row's squares flush too, although calibration saw neither."""
    build, remedy = GUARDED_NORMS[case]
    torch.manual_seed(0)
    model = build().eval()
    ep = fx16.cast_fp32_to_fp16(export(model, torch.randn(16, 32, generator=_generator(1))))
    check_program(ep)
    unseen = torch.randn(16, 32, generator=_generator(2))
    unseen[:3] = 0  # rows of zeros
    unseen[3:6] *= 1e-4  # quiet rows
    error, bad = _error_and_nonfinite(model, ep, unseen)
    assert bad == 0 and error < 3e-3
    assert not torch.isfinite(_half(model, unseen)).all()
    rows = fx16.report.report_of(ep).rows
    assert remedy in {row.rule for row in rows} | {row.stabilized.split(":")[0] for row in rows}
    assert all(row.dtype == "float16" for row in rows if row.product)


class SoftSign(nn.Module):
    """``x / (|x| + 1e-12)``: the guard keeps 0 / 0 away, and |x| is no statistic."""

    def forward(self, x):
        return x / (x.abs() + 1e-12)


def test_an_eps_of_1e_12_is_clamped_with_a_recorded_reason_and_zeros_stay_finite():
    """The guard flushes to 0 in fp16 (0 / 0 where x is 0); fx16 clamps it to the
    smallest subnormal and records why."""
    ep = fx16.cast_fp32_to_fp16(export(SoftSign(), torch.randn(16, 32, generator=_generator(1))))
    unseen = torch.randn(16, 32, generator=_generator(2))
    unseen[:3] = 0
    error, bad = _error_and_nonfinite(SoftSign(), ep, unseen)
    assert bad == 0 and error < 3e-3
    assert not torch.isfinite(_half(SoftSign(), unseen)).all()
    clamped = [row for row in fx16.report.report_of(ep).rows if row.rule == "scalar_clamped"]
    assert len(clamped) == 1 and "1e-12 -> 5.96e-08" in clamped[0].detail


def test_without_the_rewrite_the_guarded_statistic_stays_fp32_with_its_eps():
    """``stabilize=False``: mean(x^2) + 1e-12 has no lower bound above 16-bit's normal
    range, so the add (its eps kept at 1e-12), the mean and the squares stay fp32 for
    the rsqrt, whatever calibration saw. The rsqrt's result of 1e6 on a row of zeros is
    the overflow rule's, on what calibration saw: a row of zeros is calibrated here."""
    torch.manual_seed(0)
    model = RMSNormEps().eval()
    example = torch.randn(4, 32)
    example[0] = 0
    ep = fx16.cast_fp32_to_fp16(export(model, example), stabilize=False)
    nodes = {node.name: node for node in ep.graph_module.graph.nodes}
    for name in ("add", "mean", "pow_1"):
        assert nodes[name].meta[PRECISION].reason == Reason.UNDERFLOW
    assert nodes["rsqrt"].meta[PRECISION].reason == Reason.ACTIVATION_OVERFLOW
    assert "a mean or sum of squares (mean)" in nodes["rsqrt"].meta[UnderflowAnalysis.META_KEY]
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


# ---- where the small end comes from: margins at the input, statistics without a bound ----


def test_a_softmax_tail_is_judged_at_twice_its_logits():
    """Calibration's smallest probability is 2e-3, above 16-bit's normal range even with
    the margin on the output; at twice the logits it is about 4e-6, so the log and the
    softmax stay fp32, and logits six times wider hold (eager .half(): nan)."""
    torch.manual_seed(0)
    model = TailEntropy().eval()
    example = torch.randn(64, 16, generator=_generator(1))
    marks = _analyse(export(model, example))
    assert "at 2x its input" in marks["log"] and "(observed)" in marks["log"]
    assert marks["softmax"] == "feeds log, kept in fp32" and marks["linear"] is None
    ep = fx16.cast_fp32_to_fp16(export(model, example))
    unseen = 6 * torch.randn(64, 16, generator=_generator(2))
    error, bad = _error_and_nonfinite(model, ep, unseen)
    assert bad == 0 and error < 3e-3
    assert not torch.isfinite(_half(model, unseen)).all()


@pytest.mark.parametrize("divide", [False, True])
def test_a_hand_written_rms_norm_holds_near_silent_frames_it_never_saw(divide):
    """Calibrated on speech-loud frames, run on frames 1000x quieter: their squares
    flush to zero in fp16 (eager .half() is far off); the rewrite scales them into range
    in either form, ``x * rsqrt(...)`` or ``x / sqrt(...)``, and nothing stays fp32."""
    torch.manual_seed(0)
    model = FrameRmsNorm(divide=divide).eval()
    ep = fx16.cast_fp32_to_fp16(export(model, audio_frames(32, seed=1)))
    rows = fx16.report.report_of(ep).rows
    assert [row.stabilized.split(":")[0] for row in rows if row.stabilized] == ["rms_norm_scaling"]
    assert not [row for row in rows if row.kind == "float" and row.dtype == "float32"]
    quiet = audio_frames(32, seed=2, loudness=3e-4)
    error, bad = _error_and_nonfinite(model, ep, quiet)
    assert bad == 0 and error < 3e-3
    want = fp64_reference(model, quiet)[0]
    half_error = float((_half(model, quiet) - want).abs().max() / want.abs().max())
    assert not half_error < 0.1  # nan or far off


class Lambda(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function(x)


SMALL_ENDS = {
    "x / x.norm()": (lambda x: x / x.norm(dim=-1, keepdim=True), "div", "statistic", 0.0),
    "x / sqrt(mean(x*x) + 1e-8)": (
        lambda x: x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-8),
        "div",
        "statistic",
        1e-8,
    ),
    "x / clamp_min(x.std(), 1e-3)": (
        lambda x: x / x.std(-1, keepdim=True).clamp_min(1e-3),
        "div",
        "statistic",
        1e-3,
    ),
    "log(sigmoid(x) + 1e-9)": (
        lambda x: torch.log(torch.sigmoid(x) + 1e-9),
        "log",
        "exponential",
        1e-9,
    ),
    "1 / exp(x)": (lambda x: torch.reciprocal(torch.exp(x)), "reciprocal", "exponential", 0.0),
    "log(softmax(x) * 2)": (lambda x: torch.log(torch.softmax(x, -1) * 2), "log", "other", 0.0),
    "x / sum(x ** 2)": (lambda x: x / (x**2).sum(-1, keepdim=True), "div", "statistic", 0.0),
    "x / sum(x)": (lambda x: x / x.sum(-1, keepdim=True), "div", "other", 0.0),
    "x / (sum(x*x) + 0)": (
        lambda x: x / ((x * x).sum(-1, keepdim=True) + 0),
        "div",
        "statistic",
        0.0,
    ),
    "x / sum(x ** 3)": (lambda x: x / (x**3).sum(-1, keepdim=True), "div", "other", 0.0),
    "x / sum(x * flip(x))": (
        lambda x: x / (x * x.flip(-1)).sum(-1, keepdim=True),
        "div",
        "other",
        0.0,
    ),
    "x / (sum(x*x) + 1)": (
        lambda x: x / ((x * x).sum(-1, keepdim=True) + 1),
        "div",
        "statistic",
        1.0,
    ),
    "x / add(sum(x*x), 1e-3, alpha=2)": (
        lambda x: x / torch.add((x * x).sum(-1, keepdim=True), 1e-3, alpha=2),
        "div",
        "other",
        0.0,
    ),
    "x / (sum(x*x) + -1e-3)": (
        lambda x: x / ((x * x).sum(-1, keepdim=True) + -1e-3),
        "div",
        "other",
        0.0,
    ),
    "x / clamp(sum(x*x), 1e-3, 10)": (
        lambda x: x / (x * x).sum(-1, keepdim=True).clamp(1e-3, 10),
        "div",
        "statistic",
        1e-3,
    ),
    "x / clamp(sum(x*x), min=1e-3)": (
        lambda x: x / torch.clamp((x * x).sum(-1, keepdim=True), min=1e-3),
        "div",
        "statistic",
        1e-3,
    ),
    "x / clamp(sum(x*x), max=10)": (
        lambda x: x / torch.clamp((x * x).sum(-1, keepdim=True), max=10),
        "div",
        "other",
        0.0,
    ),
    "x / clamp_min(clamp_min(sum(x*x), 1e-3), 1e-5)": (
        lambda x: x / (x * x).sum(-1, keepdim=True).clamp_min(1e-3).clamp_min(1e-5),
        "div",
        "statistic",
        1e-3,
    ),
}


@pytest.mark.parametrize("case", SMALL_ENDS)
def test_the_small_end_is_found_where_the_value_comes_from(case):
    function, singular, kind, guard = SMALL_ENDS[case]
    ep = export(Lambda(function), torch.randn(4, 8))
    node = next(n for n in ep.graph.nodes if n.name == singular)
    end = small_end(node.args[1 if singular == "div" else 0])
    assert (end.kind, end.guard) == (kind, guard)


def test_an_exponential_tail_is_judged_at_its_own_power_not_as_a_probability():
    """``log(exp(x))`` with ``exp(x)`` seen in [5e-3, 0.1]: at twice its input the tail is
    about (5e-3) ** 2 = 2.5e-5, below fp16's smallest normal (6.1e-5), so the log is
    kept. Read as a softmax, relative to its largest value 0.1, it would be 2.5e-4 and
    left 16-bit; read as growing by the margin instead of its power, 1e-2."""
    function = lambda x: torch.log(torch.exp(x))  # noqa: E731
    x = torch.linspace(math.log(5e-3), math.log(0.1), 32).reshape(4, 8)
    marks = _analyse(export(Lambda(function), x))
    assert marks["log"] is not None and "at 2x its input" in marks["log"]
    assert "2.5e-05 at 2x" in marks["log"]


def test_a_guard_at_16_bit_normal_range_bounds_a_statistic():
    """``x / sqrt(mean(x^2) + 1e-4)``: a row of zeros divides by 1e-2 and a quiet row
    by at least that, in fp16 as in fp32: nothing to keep (``stabilize=False``, so no
    rewrite hides the rule)."""
    function = lambda x: x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-4)  # noqa: E731
    marks = _analyse(export(Lambda(function), torch.randn(4, 8)))
    assert not any(marks.values())


class ScaledNorm(nn.Module):
    """``h / sqrt(mean(h * h) + 1e-12)`` of ``h = 3 * x``: the squares read h."""

    def forward(self, x):
        h = x * 3
        return h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-12)


def test_a_statistic_keeps_its_chain_down_to_the_squares_not_what_they_read():
    """The divisor's chain to the squares is marked; h, which the squares read and the
    division's numerator is, is not (its fp16 values square exactly well in fp32)."""
    marks = _analyse(export(ScaledNorm(), torch.randn(4, 8)))
    assert "a mean or sum of squares (mean)" in marks["div"]
    assert all(marks[name] == "feeds div, kept in fp32" for name in ("sqrt", "add", "mean"))
    assert marks["mul_1"] == "feeds div, kept in fp32"  # the squares
    assert marks["mul"] is None and marks["x"] is None


class ShiftedDivisor(nn.Module):
    def forward(self, x, y):
        return x / (y.abs() * 1e-7 + 1e-4)


def test_the_margin_doubles_the_smallest_normal_a_value_must_stay_above():
    """A divisor in [1e-4, 1.01e-4] is above fp16's smallest normal (6.1e-5) but not
    twice it (1.22e-4, the margin): at twice the input scale it would be subnormal."""
    marks = _analyse(export(ShiftedDivisor(), torch.randn(4, 8), torch.randn(4, 8)))
    assert "with the margin (0.000122)" in marks["div"]


def test_a_second_run_clears_the_marks_of_the_first():
    """Calibrated on a tiny divisor the division is marked; calibrated again on a wide
    one, no mark of the first run is left behind."""
    x, tiny = torch.randn(4, 8), torch.randn(4, 8)
    ep = export(ShiftedDivisor(), x, tiny)
    assert _analyse(ep)["div"] is not None
    marks = _analyse(ep, calibration=[((x, tiny * 1e6), {})])
    assert not any(marks.values())


class NormWithEps(nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps)


def test_a_guard_at_exactly_the_smallest_normal_bounds_a_statistic_and_one_below_does_not():
    """fp16's smallest normal is 2**-14: a guard of exactly that keeps a silent row's
    statistic normal; half of it does not, and the rule says why, in full."""
    example = torch.randn(4, 8)
    assert _analyse(export(NormWithEps(2.0**-14), example))["rsqrt"] is None
    said = _analyse(export(NormWithEps(2.0**-15), example))["rsqrt"]
    assert said.startswith("rsqrt is singular at zero, and add is a mean or sum of squares (mean)")
    assert said.endswith(
        "guarded only by 3.05e-05, below 16-bit's smallest normal value (6.1e-05): in "
        "16-bit a quiet input's squares flush to zero"
    )


class Ratio(nn.Module):
    def forward(self, x, y):
        return x / y


class ByZero(nn.Module):
    def forward(self, x):
        return x / 0.0


def test_nothing_is_said_of_a_divisor_nothing_observed_or_of_a_scalar_zero():
    """Without calibration a divisor has no smallest magnitude to judge (and no proven
    interval): no verdict. A division by the scalar 0 is inf in any precision: none."""
    assert not any(_analyse(export(Ratio(), torch.randn(4, 8), torch.randn(4, 8)), []).values())
    assert not any(_analyse(export(ByZero(), torch.randn(4, 8))).values())


class NormDivide(nn.Module):
    def forward(self, x):
        h = x * 3
        return h / h.norm(dim=-1, keepdim=True)


def test_a_norm_keeps_itself_for_the_division_not_what_it_reads():
    marks = _analyse(export(NormDivide(), torch.randn(4, 8)))
    assert "a mean or sum of squares" in marks["div"]
    assert marks["linalg_vector_norm"] == "feeds div, kept in fp32"
    assert marks["mul"] is None and marks["x"] is None


def test_a_statistic_the_rewrite_bounds_is_not_kept_on_a_silent_row():
    """With the stable rewrite the RMSNorm's statistic is bounded below (scaled into
    range), so a row of zeros in calibration costs no fp32 for the underflow rule."""
    torch.manual_seed(0)
    example = torch.randn(4, 32)
    example[0] = 0
    ep = fx16.cast_fp32_to_fp16(export(RMSNormEps(eps=1e-6).eval(), example))
    kept = [node.name for node in ep.graph.nodes if node.meta.get(UnderflowAnalysis.META_KEY)]
    assert kept == []


def test_an_exponential_tail_whose_square_is_exactly_the_smallest_normal_is_left_16_bit():
    """``exp`` of -4.852030277252197 is 2**-7 exactly in fp32; at twice its input the
    tail is (2**-7)**2 = 2**-14, fp16's smallest normal itself, which is not below it:
    the log is left 16-bit. One fp32 step further down, it is kept."""
    function = lambda x: torch.log(torch.exp(x))  # noqa: E731
    edge = torch.tensor(-4.852030277252197)
    assert torch.exp(edge).item() == 2.0**-7
    x = torch.linspace(-1.0, -0.1, 32).reshape(4, 8)
    x[0, 0] = edge
    assert _analyse(export(Lambda(function), x))["log"] is None
    x[0, 0] = torch.nextafter(edge, torch.tensor(-10.0))
    assert "at 2x its input" in _analyse(export(Lambda(function), x))["log"]


class GuardedSoftmaxLog(nn.Module):
    def __init__(self, guard: float) -> None:
        super().__init__()
        self.guard = guard

    def forward(self, x):
        return torch.log(x.softmax(-1) + self.guard)


def test_a_softmax_tail_is_widened_relative_to_a_largest_value_of_at_most_one():
    """``log(softmax(x) + g)``: the tail at twice the logits is (s / l) ** 2 * l, l the
    largest value seen, but never more than 1 (a probability's). With a guard the
    largest seen passes 1 (here 1 + 7.8e-3); counted as it is, the tail would shrink
    by that 0.8% below fp16's smallest normal. With s**2 0.2% above it, the log is
    left 16-bit; 0.5% below it, kept."""
    logits = torch.zeros(4, 8)
    logits[:, 0] = 40.0  # one probability of about 1, seven of about 4e-18
    for smallest, kept in ((2.0**-7 * 1.001, False), (2.0**-7 * 0.9975, True)):
        marks = _analyse(export(GuardedSoftmaxLog(smallest), logits))
        assert (marks["log"] is not None) == kept, smallest


class WideProduct(nn.Module):
    """Two readings from 10 to 1e6, their product (1e2 to 1e12, past fp16's range) added to
    one of them, and ``x * rsqrt(|x * y| + 1e-3)``: a scale domain carries the product at
    about 2**-25, where its small elements (1e2) are subnormal."""

    def forward(self, x, y):
        product = x * y
        return x + product, x * torch.rsqrt(product.abs() + 1e-3)


def test_an_argument_a_scale_domain_carried_below_the_range_is_judged_there():
    """The rsqrt reads its argument unscaled (100 and up), but the domain computed it at
    2**-25 (3e-6: subnormal, its guard 1e-3 clamped to fp16's smallest subnormal, 2
    unscaled): the verdict judges the argument where it was carried and keeps its chain
    fp32; the second output holds 16-bit rounding (0.12 off before)."""
    torch.manual_seed(0)
    x = 10 * (1 + 1e5 * torch.rand(4, 8))
    x[0, 0] = 10.0
    y = x * (1 + 0.01 * torch.rand(4, 8))
    model = WideProduct()
    ep = fx16.cast_fp32_to_fp16(export(model, x, y))
    check_program(ep)
    (rsqrt,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.rsqrt.default]
    decision = rsqrt.meta[PRECISION]
    assert decision.reason is Reason.UNDERFLOW
    assert "a scale domain carried it at 2**" in decision.detail
    reference, got = fp64_reference(model, x, y), run(ep, x, y)
    assert max_error(reference[1:], got[1:]) < 4 * 2.0**-11


def test_an_argument_a_scale_domain_lifted_is_judged_at_its_own_scale():
    """x @ gain (1e-9 weights) is carried at 2**26 (about 6e-3 and up): the reciprocal that
    reads it is judged there, not 2**26 lower, and computes in fp16."""
    from benchmarks.range import TinyWeights

    torch.manual_seed(0)
    model, x = TinyWeights().eval(), torch.randn(4, 32)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    (reciprocal,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.reciprocal.default]
    assert reciprocal.meta[PRECISION].dtype == torch.float16
    assert max_error(fp64_reference(model, x), run(ep, x)) < 0.02
