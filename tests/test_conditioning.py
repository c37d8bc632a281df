"""ConditioningAnalysis: ops that amplify 16-bit input rounding stay fp32, with what they read.

The traps: rotary angles from cache positions, diffusion timesteps, sinusoidal
position tables from a dynamic sequence length, exp of large logits, log near 1, and
cancelling subtractions. Each is checked on its decision alone, then against fp64.
"""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from benchmarks.precision_zoo import RotaryAttention, SinusoidalPositions, TimestepEmbedding
from fx16 import meta
from fx16.analysis import CalibrationAnalysis, ConditioningAnalysis, ValueRangeAnalysis
from fx16.analysis.conditioning import (
    _cancellation,
    _centering,
    _exponential,
    _logarithm,
    _Ranges,
    _with_interval,
)
from fx16.decisions import PRECISION, Reason
from fx16.ops.numerics import INF_LIKE
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.program.stats import relative_error
from helpers import check_program, export, fp64_reference, node_named, run

KEY = ConditioningAnalysis.META_KEY


def _analyse(ep, policy=None, calibration=None):
    program = Program(ep)
    CalibrationAnalysis(program, calibration)(ep.graph_module)
    ValueRangeAnalysis(program)(ep.graph_module)
    result = ConditioningAnalysis(program, policy)(ep.graph_module)
    assert result.modified is False and result.graph_module is ep.graph_module
    return {node.name: node.meta.get(KEY) for node in ep.graph_module.graph.nodes}


def _fp64_error(model, ep, *args):
    return relative_error(fp64_reference(model, *args)[0], run(ep, *args)[0].double())


class Angles(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.sin(torch.arange(x.shape[-1]).float() * self.scale) + x


def test_sin_of_large_proven_angles_is_kept_with_its_chain():
    marks = _analyse(export(Angles(1.0), torch.randn(4, 2048)))
    assert "sin of values up to 2047" in marks["sin"]
    assert marks["mul"] and marks["to"]  # the angle and the float made from arange
    assert marks["add"] is None  # downstream of the sin: not its business


def test_sin_of_small_proven_angles_is_left_alone():
    marks = _analyse(export(Angles(9e-4), torch.randn(4, 2048)))  # angles below 2 rad
    assert marks["sin"] is None


class SinOfInput(nn.Module):
    def forward(self, x):
        return torch.sin(x * 3.0)


def test_sin_of_a_value_with_no_proven_range_is_kept_but_not_its_producers_work():
    marks = _analyse(export(SinOfInput(), torch.randn(4, 8)))
    assert "no proven range" in marks["sin"]
    assert marks["mul"] and marks["x"]  # elementwise chain up to the input


class Exp(nn.Module):
    def __init__(self, shift):
        super().__init__()
        self.shift = shift

    def forward(self, x):
        return torch.exp(x + self.shift)


class ShiftedExp(nn.Module):
    def forward(self, x):
        return torch.exp(x - x.amax(-1, keepdim=True))


def test_exp_of_large_arguments_is_ill_conditioned_exp_of_shifted_logits_is_not():
    x = 3 * torch.randn(4, 8)
    assert "exp of values in" in _analyse(export(Exp(20.0), x))["exp"]
    assert _analyse(export(ShiftedExp(), x))["exp"] is None  # softmax's exp: largest is 1


class LogNearOne(nn.Module):
    def forward(self, x):
        return torch.log(1.0 + 1e-3 * torch.sigmoid(x))


def test_log_near_one_is_ill_conditioned():
    assert "log of values in" in _analyse(export(LogNearOne(), torch.randn(4, 8)))["log"]


class Cancel(nn.Module):
    def __init__(self, offset):
        super().__init__()
        self.register_buffer("offset", torch.full((8,), offset))

    def forward(self, x):
        return (x + self.offset) - self.offset


def test_cancelling_subtraction_is_kept_with_both_operands():
    marks = _analyse(export(Cancel(1000.0), torch.randn(4, 8)))
    assert "a - b" in marks["sub"]
    assert marks["add"] and marks["b_offset"]
    assert _analyse(export(Cancel(0.5), torch.randn(4, 8)))["sub"] is None


class Residual(nn.Module):
    def forward(self, x, y):
        return x + y


def test_a_residual_add_is_no_cancellation():
    # maxima of different elements: (|a| + |b|) / |a + b| near 2, nothing cancels
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 64, generator=generator), torch.randn(64, 64, generator=generator)
    assert _analyse(export(Residual(), x, y))["add"] is None


def test_an_infinite_tolerance_turns_the_rule_off():
    policy = PrecisionPolicy.custom(precision_tolerance=math.inf)
    assert _analyse(export(Angles(1.0), torch.randn(4, 2048)), policy)["sin"] is None


def test_the_tolerance_is_the_policys():
    ep = lambda: export(Angles(8.0 / 2047), torch.randn(1, 2048))  # noqa: E731 - kappa 8
    assert _analyse(ep())["sin"] is not None  # 8 x 2**-11 > 2**-10
    assert _analyse(ep(), PrecisionPolicy.custom(precision_tolerance=1e-2))["sin"] is None


# ---- the traps, end to end, against fp64 ------------------------------------------------


def test_timestep_embedding_at_t_999_is_within_3e_3_of_fp64():
    torch.manual_seed(0)
    model = TimestepEmbedding().eval()
    for example in (torch.tensor([10, 500]), torch.tensor([10.0, 500.0])):  # int or float t
        ep = fx16.cast_fp32_to_fp16(export(model, example))
        check_program(ep)
        largest = torch.tensor([999, 998], dtype=example.dtype)
        assert _fp64_error(model, ep, largest) <= 3e-3
        rows = {row.node: row for row in fx16.report.report_of(ep).rows}
        assert rows["sin"].rule == "ill_conditioned" and rows["linear"].dtype == "float16"


def test_sinusoidal_table_of_a_dynamic_sequence_uses_the_proven_length():
    torch.manual_seed(0)
    model = SinusoidalPositions().eval()
    seq = torch.export.Dim("seq", min=2, max=2048)
    ep = torch.export.export(model, (torch.randn(1, 16, 64),), dynamic_shapes=({1: seq},))
    fx16.cast_fp32_to_fp16(ep)  # calibrated on seq=16 only
    assert _fp64_error(model, ep, torch.randn(1, 2048, 64)) <= 3e-3


def _decode_errors(model, ep, start, steps=6):
    """Prefill ``start`` positions, then decode ``steps`` tokens, on the fp32 program and
    ``ep``: the error of each decode step."""
    reference = copy.deepcopy(model)
    cast = ep.module()
    generator = torch.Generator().manual_seed(1)
    prefill = torch.randn(start, 64, generator=generator)
    with torch.no_grad():
        reference(prefill, torch.arange(start))
        cast(prefill.half(), torch.arange(start))
        errors = []
        for position in range(start, start + steps):
            x = torch.randn(1, 64, generator=generator)
            want = reference(x, torch.tensor([position]))
            errors.append(relative_error(want, cast(x.half(), torch.tensor([position])).float()))
    return errors


def test_rotary_decode_at_positions_beyond_1500_stays_within_5e_3():
    torch.manual_seed(0)
    model = RotaryAttention().eval()
    n = torch.export.Dim("n", max=2048)
    ep = torch.export.export(
        copy.deepcopy(model),
        (torch.randn(4, 64), torch.arange(4)),
        dynamic_shapes=({0: n}, {0: n}),
    )
    fx16.cast_fp32_to_fp16(ep)
    nodes = {node.name: node for node in ep.graph_module.graph.nodes}
    # positions have no declared range, but they index a cache of 2048: angles < 2048
    assert nodes["b_inv_freq"].meta[PRECISION].reason == Reason.ILL_CONDITIONED
    assert nodes["b_inv_freq"].meta["val"].dtype == torch.float32
    assert max(_decode_errors(model, ep, 2040)) <= 5e-3


@settings(max_examples=examples(12), deadline=None)
@given(st.integers(16, 4096), st.floats(1e-3, 4.0))
def test_property_sinusoids_of_positions_stay_accurate(length, scale):
    model = Angles(scale).eval()
    ep = fx16.cast_fp32_to_fp16(export(model, torch.zeros(1, length)))
    x = torch.zeros(1, length)
    assert _fp64_error(model, ep, x) <= 3e-3


# ---- the condition numbers themselves, against oracles that share no code --------------

aten = torch.ops.aten


@settings(max_examples=examples(60), deadline=None)
@given(
    scale=st.sampled_from([1.0, math.log(2.0), 0.1, 3.0]),
    low=st.floats(-40, 40),
    width=st.floats(0.01, 40),
)
def test_property_the_exponentials_kappa_is_its_largest_value_on_the_interval(scale, low, width):
    """Oracle: max |x f'(x)| / max |f| of f = e^(scale x), on a dense grid of [low, high]."""
    high = low + width
    grid = torch.linspace(low, high, 200_001, dtype=torch.float64)
    value = grid.mul(scale).exp()
    oracle = float((grid.abs() * scale * value).max() / value.max())
    assert _exponential(scale)(low, high) == pytest.approx(oracle, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize(
    ("low", "high", "kappa"),
    [
        (math.e, math.e**2, 0.5),
        (0.5, 2.0, 1 / math.log(2.0)),
        (1.0, math.e, 1.0),
        (math.exp(-3), 1.0, 1 / 3),
        (1.0, 1.0, math.inf),  # log of exactly 1: any rounding is all of the result
        (0.0, 5.0, 0.0),  # outside log's domain: not a rounding question
        (-2.0, 5.0, 0.0),
    ],
)
def test_the_logarithms_kappa(low, high, kappa):
    assert _logarithm(low, high) == pytest.approx(kappa)


def test_an_interval_that_is_missing_or_unbounded_gives_no_condition_number():
    def twice_high(low, high):
        return 2 * high

    assert _with_interval(None, "exp", twice_high) is None
    assert _with_interval((-math.inf, 1.0), "exp", twice_high) is None
    assert _with_interval((0.0, math.nan), "exp", twice_high) is None
    assert _with_interval((-1.0, 3.0), "exp", twice_high) == (6.0, "exp of values in [-1, 3]")


class _Proven:
    """A FloatRanges stand-in: the proven interval of each value by name, and state."""

    def __init__(self, intervals: dict, state: dict | None = None) -> None:
        self.intervals, self.state = intervals, state or {}

    def of(self, arg):
        found = self.intervals.get(getattr(arg, "name", arg))
        return None if found is None else SimpleNamespace(low=found[0], high=found[1])

    def state_tensor(self, arg):
        return self.state.get(getattr(arg, "name", arg))


def _graph_node(target, *names, val=None) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(name) for name in names]
    node = graph.call_function(target, tuple(inputs))
    node.meta["val"] = torch.empty(3) if val is None else val
    return node, inputs


def test_the_interval_read_is_the_proven_one_else_the_observed_one():
    node, (x, y, z) = _graph_node(aten.add.Tensor, "x", "y", "z")
    y.meta[meta.OBSERVED_INTERVAL], y.meta[meta.OBSERVED_MAX_ABS] = (-3.0, 2.0), 3.0
    z.meta[meta.OBSERVED_MAX_ABS] = 7.0
    ranges = _Ranges(_Proven({"x": (-5.0, 4.0), "y": (1.0, 2.0), "s": (-INF_LIKE, -INF_LIKE)}))
    assert ranges.interval(x) == (-5.0, 4.0) and ranges.magnitude(x) == 5.0
    assert ranges.interval(y) == (1.0, 2.0) and ranges.magnitude(y) == 2.0  # proven first
    assert ranges.interval(z) is None and ranges.magnitude(z) == 7.0  # observed
    assert ranges.interval("s") is None  # a sentinel and nothing else
    assert _Ranges(_Proven({"i": (INF_LIKE, INF_LIKE)})).interval("i") is None
    # a Python number's magnitude is its own (x - 1000.0 cancels as x - tensor(1000.0))
    assert ranges.magnitude(2.0) == 2.0 and ranges.magnitude(-3) == 3.0


class _Magnitudes:
    def __init__(self, **values) -> None:
        self.values = values

    def magnitude(self, arg):
        return self.values.get(arg.name)


@pytest.mark.parametrize(
    ("target", "a", "b", "result", "sliced", "want"),
    [
        (
            aten.sub.Tensor,
            1000.0,
            10.0,
            1.0,
            None,
            (1010.0, "a - b with |a| ~ 1e+03, |b| ~ 10, result 1"),
        ),
        (
            aten.add.Tensor,
            4.0,
            4.0,
            1.0,
            None,
            (8.0, "a + b with |a| ~ 4, |b| ~ 4, result 1"),
        ),  # 8: cancels
        (aten.add.Tensor, 4.0, 3.99, 1.0, None, None),  # just under 8
        (aten.sub.Tensor, 4.0, 4.0, 0.0, None, None),  # a zero result: no ratio
        (aten.sub.Tensor, INF_LIKE, 1.0, 1.0, None, None),  # an additive mask's sentinel
        (aten.sub.Tensor, 1.0, INF_LIKE, 1.0, None, None),
        (aten.sub.Tensor, None, 1.0, 1.0, None, None),
        (aten.sub.Tensor, 1.0, None, 1.0, None, None),
        (aten.sub.Tensor, 2.0, 2.0, 2.0, 50.0, (50.0, "per slice")),  # the worst slice
        (aten.sub.Tensor, 100.0, 100.0, 2.0, 50.0, (100.0, "a - b with")),  # the whole is worse
        (aten.sub.Tensor, 2.0, 2.0, 2.0, 8.0, (8.0, "per slice")),
        (aten.sub.Tensor, 8.0, 8.0, 2.0, 8.0, (8.0, "a - b with")),  # a tie: the whole
        (aten.sub.Tensor, 4.0, 4.0, 0.0, 50.0, (50.0, "(observed; over the whole tensor 0x)")),
    ],
)
def test_the_cancellation_ratio_of_a_sum(target, a, b, result, sliced, want):
    node, (left, right) = _graph_node(target, "a", "b")
    if sliced is not None:
        node.meta[CalibrationAnalysis.CENTERING_KEY] = sliced
    got = _cancellation(node, _Magnitudes(a=a, b=b, **{node.name: result}))
    if want is None:
        assert got is None
    else:
        assert got[0] == pytest.approx(want[0]) and want[1] in got[1]


def test_the_cancellation_inside_a_norm_is_observed_else_read_from_running_statistics():
    norm = aten._native_batch_norm_legit_no_training.default
    node, _ = _graph_node(norm, "x", "w", "b", "mean", "var")
    node.args = (*node.args, 0.1, 1e-5)
    node.meta[CalibrationAnalysis.CENTERING_KEY] = 10.0
    assert _centering(node, _Proven({}))[0] == 10.0
    assert "(observed)" in _centering(node, _Proven({}))[1]
    node.meta[CalibrationAnalysis.CENTERING_KEY] = 8.0  # three bits lost: cancels
    assert _centering(node, _Proven({}))[0] == 8.0
    node.meta[CalibrationAnalysis.CENTERING_KEY] = 7.99
    assert _centering(node, _Proven({})) is None
    del node.meta[CalibrationAnalysis.CENTERING_KEY]
    mean, var = torch.tensor([40.0, 1.0]), torch.tensor([4.0, 1.0])
    got = _centering(node, _Proven({}, {"mean": mean, "var": var}))
    assert got[0] == pytest.approx(40 / math.sqrt(4 + 1e-5))
    assert got[1].endswith("largest deviation from the mean (from its running statistics)")
    assert _centering(node, _Proven({}, {"mean": mean})) is None  # one statistic unknown
    assert _centering(node, _Proven({}, {"mean": mean * 0.1, "var": var})) is None  # 2: no
    layer, _ = _graph_node(aten.layer_norm.default, "x", "shape")
    assert _centering(layer, _Proven({}, {"mean": mean, "var": var})) is None


def test_the_mark_states_the_condition_number_and_the_error_it_gives():
    """sin of angles up to 8 (kappa 8): fp16's unit roundoff is 2**-11, so its input's
    rounding moves it by 8 * 2**-11 = 0.0039, above the default 2**-10."""
    mark = _analyse(export(Angles(8.0 / 2047), torch.randn(1, 2048)))["sin"]
    assert mark == (
        "sin of values up to 8: condition number 8, so 16-bit rounding of its input moves "
        "it by 0.0039 (tolerance 0.00098)"
    )


def test_a_second_run_clears_the_first_runs_marks_and_findings():
    ep = export(Angles(1.0), torch.randn(4, 2048))
    assert _analyse(ep)["sin"] is not None
    sin = next(node for node in ep.graph.nodes if node.name == "sin")
    assert isinstance(sin.meta[ConditioningAnalysis.FINDING_KEY].kappa, float)
    policy = PrecisionPolicy.custom(precision_tolerance=math.inf)
    assert all(mark is None for mark in _analyse(ep, policy).values())
    assert not any(ConditioningAnalysis.FINDING_KEY in node.meta for node in ep.graph.nodes)


class PowerOfTen(nn.Module):
    def forward(self, x):
        return torch.pow(10.0, x)


def test_a_power_of_a_number_is_conditioned_by_its_exponents_range():
    """pow(b, x): kappa = max |x ln b|; over [-2, 3] with b = 10, 3 ln 10 = 6.9."""
    x = torch.tensor([-2.0, 0.5, 3.0])
    mark = _analyse(export(PowerOfTen(), x))["pow_1"]
    assert mark.startswith("10 ** x of values in [-2, 3]: condition number 6.91,")
    assert _analyse(export(PowerOfTen(), x * 0.1))["pow_1"] is None  # kappa 0.69


def test_a_periodic_op_of_small_angles_counts_a_condition_number_of_one():
    """Below 1 rad the relative error of sin stays that of its input: kappa 1, which a
    tolerance between 1 and 2 units of roundoff (6e-4) lets pass."""
    policy = PrecisionPolicy.custom(precision_tolerance=6e-4)
    assert _analyse(export(Angles(0.5 / 2047), torch.randn(1, 2048)), policy)["sin"] is None
    assert _analyse(export(Angles(1.5 / 2047), torch.randn(1, 2048)), policy)["sin"]


class Powers(nn.Module):
    def forward(self, x):
        return torch.pow(0.0, x), torch.pow(0.5, x), x**12, x - 10.0


def test_each_power_rule_reads_its_own_operand():
    """pow(0, x) is no rounding question; pow(0.5, x) over [-20, 10]: kappa 20 ln 2 = 13.9;
    x ** 12: kappa 12; x - 10 (a number, not two tensors): no cancellation rule."""
    marks = _analyse(export(Powers(), torch.tensor([-20.0, 1.0, 10.0])))
    pows = [name for name in marks if name.startswith("pow")]
    assert marks[pows[0]] is None
    assert marks[pows[1]].startswith("0.5 ** x of values in [-20, 10]: condition number 13.9,")
    assert marks[pows[2]].startswith("x ** 12: condition number 12,")
    assert marks["sub"] is None


class OffsetThatCancels(torch.nn.Module):
    """``lin(x - 1000)`` in each form a model writes it, on inputs near 1000 (kelvin,
    timestamps, raw sensor counts with a bias)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.lin = form, torch.nn.Linear(8, 8)
        self.register_buffer("offset", torch.tensor(1000.0))

    def forward(self, x):
        shifted = {
            "python float": lambda: x - 1000.0,
            "python int": lambda: x - 1000,
            "adding a negative": lambda: x + (-1000.0),
            "reversed": lambda: 1000.0 - x,
            "buffer": lambda: x - self.offset,
        }[self.form]()
        return self.lin(shifted)


@pytest.mark.parametrize(
    "form", ["python float", "python int", "adding a negative", "reversed", "buffer"]
)
def test_a_scalar_offset_that_cancels_is_judged_as_a_tensor_one(form):
    """Input graph: x -> sub(x, 1000.0) -> linear. Output graph: x and the subtraction
    fp32 (``ill_conditioned``), the linear 16-bit. Once only the buffer's form was kept
    fp32: a Python number's was cast at the door (fp16's spacing at 1000 is 0.5),
    13.5% off and reported as fitting."""
    import fx16
    from fx16.decisions import PRECISION, Reason
    from helpers import max_error

    torch.manual_seed(0)
    model = OffsetThatCancels(form).eval()
    calibration = [(1000 + torch.randn(4, 8),) for _ in range(4)]
    ep = fx16.cast_fp32_to_fp16(export(model, *calibration[0]), calibration=calibration)
    offset = next(n for n in ep.graph.nodes if n.name in ("sub", "add", "rsub"))
    assert offset.meta[PRECISION].reason is Reason.ILL_CONDITIONED
    assert node_named(ep, "x").meta["val"].dtype == torch.float32
    assert fx16.report.report_of(ep).totals.flop_share_16bit == 1.0
    x = 1000 + torch.randn(4, 8)
    assert max_error(fp64_reference(model, x), run(ep, x)) < 2e-3
