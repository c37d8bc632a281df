"""CalibrationAnalysis, and the fp16 inserter keeping observed overflows in fp32."""

import math

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from benchmarks.zoo import ExpLogits, ScaledAttention, SquaredSum
from fx16.analysis import CalibrationAnalysis
from fx16.analysis.fp32_rules import UnderflowRule
from fx16.analysis.magnitudes import (
    MagnitudeRecorder,
    observe_floats,
    smallest_nonzero_magnitude,
)
from fx16.decisions import PRECISION, Reason
from fx16.ops.numerics import INF_LIKE
from fx16.pipelines import run_passes, without_rules
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.report import report_of
from fx16.testing import programs
from helpers import check_program, export, fp64_reference, max_error, run, state_snapshot
from models import BufferUpdate, MaskedAttention

aten = torch.ops.aten
KEY = CalibrationAnalysis.META_KEY


def SumOfSquares():  # noqa: N802 - reads like the class it builds
    """linear -> pow(2) -> sum -> x / sqrt(sum): the sum overflows fp16, the output does not."""
    return SquaredSum(width=8, features=64, scale=60.0)


def _by_target(ep, target):
    return next(n for n in ep.graph_module.graph.nodes if n.target == target)


def test_records_the_largest_magnitude_and_changes_nothing():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = SumOfSquares()
    ep = export(model, x)
    code = ep.graph_module.code
    assert not CalibrationAnalysis(Program(ep))(ep.graph_module).modified
    assert ep.graph_module.code == code
    with torch.no_grad():
        expected = model.fc(x).pow(2).sum(-1).max().item()
    assert abs(_by_target(ep, aten.sum.dim_IntList).meta[KEY] - expected) <= 1e-3 * expected
    assert _by_target(ep, aten.linear.default).meta[KEY] > 0


def test_sum_of_squares_stays_fp32_and_returns_to_fp16():
    """linear:f16 -> pow:f32 -> sum:f32 -> sqrt -> div -> to(f16): no inf, small error
    (without the stable rewrite, which would scale the squares into range instead)."""
    torch.manual_seed(0)
    model, x = SumOfSquares(), torch.randn(4, 8)
    no_scaling = PrecisionPolicy(scale_range=False)  # scale domains would carry it 16-bit
    ep = fx16.cast_fp32_to_fp16(export(model, x), stabilize=False, policy=no_scaling)
    check_program(ep)
    assert _by_target(ep, aten.sum.dim_IntList).meta["val"].dtype == torch.float32
    assert _by_target(ep, aten.sum.dim_IntList).meta[PRECISION].reason == Reason.ACTIVATION_OVERFLOW
    assert _by_target(ep, aten.linear.default).meta["val"].dtype == torch.float16
    outputs = run(ep, x)
    assert outputs[0].dtype == torch.float16
    assert max_error(fp64_reference(model, x), outputs) < 1e-2


def test_without_calibration_the_energy_holds_by_rewrite_or_by_its_missing_lower_bound():
    """Without calibration nothing shows the sum of squares overflowing. By default the
    stable rewrite scales the squares into range, and everything runs in 16-bit. Without
    it, a sum of squares under a division has no lower bound either (a silent input),
    so the underflow rule keeps that chain fp32 whatever calibration saw. With that rule
    out too, the sum becomes inf and the output collapses, as coreai-opt's does."""
    torch.manual_seed(0)
    model, x = SumOfSquares(), torch.randn(4, 8)
    ep = fx16.cast_fp32_to_fp16(export(model, x), calibration=[])
    assert max_error(fp64_reference(model, x), run(ep, x)) < 3e-3
    rows = report_of(ep).rows
    assert [r.stabilized for r in rows if r.stabilized] == [
        "rms_norm_scaling: sum of squares, no eps"
    ]
    assert not [r for r in rows if r.kind == "float" and r.dtype == "float32"]
    ep = fx16.cast_fp32_to_fp16(export(model, x), calibration=[], stabilize=False)
    assert max_error(fp64_reference(model, x), run(ep, x)) < 3e-3
    rules = {row.node: row.rule for row in report_of(ep).rows}
    assert rules["sum_1"] == rules["sqrt"] == rules["div"] == "underflow"
    bare = export(model, x)
    passes = fx16.fp16_passes(bare, calibration=[], stabilize=False)
    run_passes(without_rules(passes, UnderflowRule), bare.graph_module)
    assert max_error(fp64_reference(model, x), run(bare, x)) > 0.5


def test_explicit_calibration_inputs_and_margin():
    torch.manual_seed(0)
    model = SumOfSquares()
    small = torch.randn(4, 8) * 1e-3
    ep = export(model, small)
    CalibrationAnalysis(Program(ep), [(small,), ((small * 1e3,), {})])(ep.graph_module)
    with torch.no_grad():
        expected = model.fc(small * 1e3).pow(2).sum(-1).max().item()
    assert abs(_by_target(ep, aten.sum.dim_IntList).meta[KEY] - expected) <= 1e-3 * expected


def test_buffers_updated_in_place_are_not_changed_by_calibration():
    ep = export(BufferUpdate(), torch.randn(3, 4))
    before = state_snapshot(ep)
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    assert torch.equal(before[1]["running"][1], ep.state_dict["running"])


def test_no_inputs_means_no_findings_and_a_status():
    ep = export(SumOfSquares(), torch.randn(2, 8))
    ep.example_inputs = None
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    assert "skipped" in ep.graph_module.meta[CalibrationAnalysis.STATUS_KEY]
    assert not any(KEY in n.meta for n in ep.graph_module.graph.nodes)


def test_minus_1e9_mask_is_kept_fp32_until_softmax():
    """masked_fill(-1e9) stays fp32 (no cast-back to -inf); softmax returns to fp16."""
    torch.manual_seed(0)
    keep = torch.tensor([[True, True, False, False], [False, False, False, False]])
    model, args = MaskedAttention(fill=-1e9), (torch.randn(2, 4, 16), keep)
    ep = fx16.cast_fp32_to_fp16(export(model, *args))
    check_program(ep)
    fill = _by_target(ep, aten.masked_fill.Scalar)
    assert all(user.target != aten._to_copy.default for user in fill.users)
    outputs = run(ep, *args)
    assert torch.isfinite(outputs[0]).all()  # even the fully masked row
    assert max_error(fp64_reference(model, *args), outputs) < 1e-2


@settings(max_examples=15, deadline=None)
@given(st.floats(min_value=1.0, max_value=1e6), st.floats(min_value=1.0, max_value=1e4))
def test_no_overflow_that_fp32_did_not_have(input_scale, weight_scale):
    torch.manual_seed(0)
    model = SumOfSquares()
    with torch.no_grad():
        model.fc.weight.mul_(weight_scale / 60.0)
    x = torch.randn(3, 8) * input_scale
    ep = export(model, x)
    with torch.no_grad():
        reference = model(x)
    fx16.cast_fp32_to_fp16(ep)
    output = run(ep, x)[0]
    assert torch.isfinite(output).all() == torch.isfinite(reference).all()


class SentinelThenLinear(torch.nn.Module):
    """x + finfo.min is a sentinel; a Linear on it would read a saturated -65504."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x + torch.finfo(torch.float32).min) * 1e-30


def test_sentinels_stay_fp16_only_where_every_use_tolerates_saturation():
    """masked_fill(finfo.min) -> softmax: fp16.  x + finfo.min -> linear: kept fp32."""
    torch.manual_seed(0)
    keep = torch.tensor([[True, True, False, False]])
    ep = fx16.cast_fp32_to_fp16(
        export(MaskedAttention(fill=torch.finfo(torch.float32).min), torch.randn(1, 4, 16), keep)
    )
    assert _by_target(ep, aten.masked_fill.Scalar).meta["val"].dtype == torch.float16

    model, x = SentinelThenLinear(), torch.randn(2, 4)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    add = _by_target(ep, aten.add.Tensor)
    assert add.meta[KEY] == float("inf")
    assert add.meta["val"].dtype == torch.float32
    with torch.no_grad():
        expected = model(x)
    got = run(ep, x)[0]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected.double(), rtol=1e-2, atol=0)


def test_exp_of_large_logits_is_finite_and_accurate():
    torch.manual_seed(0)
    model, x = ExpLogits(width=8, features=16), torch.randn(3, 8) * 0.1
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    assert _by_target(ep, aten.exp.default).meta["val"].dtype == torch.float32
    outputs = run(ep, x)
    assert torch.isfinite(outputs[0]).all()
    assert max_error(fp64_reference(model, x), outputs) < 1e-2


def test_attention_scores_beyond_fp16_are_finite_and_accurate():
    torch.manual_seed(0)
    model, x = ScaledAttention(16, scale=150.0), torch.randn(2, 6, 16)
    with torch.no_grad():
        assert (model.q(x) @ model.k(x).transpose(-1, -2)).abs().max() > 65504
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    outputs = run(ep, x)
    assert torch.isfinite(outputs[0]).all()
    assert max_error(fp64_reference(model, x), outputs) < 1e-2


def test_weights_are_observed_once_whatever_the_number_of_inputs(monkeypatch):
    import fx16.analysis.magnitudes as magnitudes

    torch.manual_seed(0)
    ep = export(SquaredSum(), torch.randn(4, 16))
    weights = {id(t) for t in ep.state_dict.values()}
    observed = []
    observe = magnitudes.observe_floats
    monkeypatch.setattr(
        magnitudes, "observe_floats", lambda value: observed.append(id(value)) or observe(value)
    )
    inputs = [(torch.randn(4, 16),) for _ in range(3)]
    CalibrationAnalysis(Program(ep), inputs)(ep.graph_module)
    assert weights and all(observed.count(weight) == 1 for weight in weights)
    assert len(observed) > 3 * len(weights)  # everything else, on every input


class DropoutBetween(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.fc(x)) * 3.0


def test_a_dropout_not_training_records_its_inputs_observations_without_reducing(monkeypatch):
    """In an eval export a dropout returns its input: it records what its input recorded
    (what reducing it would give) and its values are not reduced again."""
    import fx16.analysis.magnitudes as magnitudes

    torch.manual_seed(0)
    ep = export(DropoutBetween().eval(), torch.randn(4, 8) * 50)
    dropout = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.dropout.default)
    observed = []
    observe = magnitudes.observe_floats
    monkeypatch.setattr(
        magnitudes, "observe_floats", lambda value: observed.append(value) or observe(value)
    )
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    source = dropout.args[0]
    assert len([value for value in observed if value.shape == (4, 8)]) == 3  # x, fc, product
    keys = (CalibrationAnalysis.META_KEY, CalibrationAnalysis.INTERVAL_KEY)
    assert all(dropout.meta[key] == source.meta[key] for key in keys)
    assert dropout.meta[CalibrationAnalysis.META_KEY] > 1.0  # it was observed, scaled

    args = (source, 0.1, True)
    training = torch.fx.Node(ep.graph, "d", "call_function", dropout.target, args, {})
    assert not magnitudes._holds_input_values(training)


class DropoutInBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: self.drop(x * 40.0) + 1.0, lambda x: x - 1.0, (x,))


def test_inside_a_cond_branch_a_dropout_not_training_records_its_inputs_observations(
    monkeypatch,
):
    """Bodies too: the branch's dropout takes what its input (x * 40) recorded instead of
    being reduced, and that is what reducing it gives."""
    import fx16.analysis.magnitudes as magnitudes

    torch.manual_seed(0)
    x = torch.rand(4, 8) + 0.5  # the branch with the dropout is taken
    ep = export(DropoutInBranch().eval(), x)
    shortcut, holds = [], magnitudes._holds_input_values

    def recorded(node):
        if holds(node):
            shortcut.append(node)
            return True
        return False

    monkeypatch.setattr(magnitudes, "_holds_input_values", recorded)
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    dropouts = [
        node
        for module in ep.graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.target == torch.ops.aten.dropout.default
    ]
    assert len(dropouts) == 1 and dropouts[0].graph is not ep.graph_module.graph
    (dropout,) = dropouts
    assert dropout in shortcut
    source = dropout.args[0]
    expected = float((x * 40.0).abs().max())
    assert dropout.meta[CalibrationAnalysis.META_KEY] == source.meta[CalibrationAnalysis.META_KEY]
    assert dropout.meta[CalibrationAnalysis.META_KEY] == pytest.approx(expected)
    low, high = dropout.meta[CalibrationAnalysis.INTERVAL_KEY]
    assert (low, high) == pytest.approx((float((x * 40).min()), float((x * 40).max())))


class CastsInBranches(torch.nn.Module):
    """An fp16 input widened in either branch; the branch not taken also narrows the
    widened value again and widens that."""

    def forward(self, x):
        return torch.cond(
            x.float().sum() > 0,
            lambda a: a.float() * 2.0,
            lambda a: a.float() + a.float().half().float(),
            (x,),
        )


def test_an_exact_cast_no_run_reached_holds_what_its_source_holds():
    """The branch not taken: its placeholder holds the operand's observations, the
    widening cast of it the same (its values are the placeholder's); the narrowing cast
    and the cast after it hold none (fp16 may overflow where fp32 did not)."""
    x = (torch.rand(2, 3) + 0.5).half()  # the true branch is taken
    ep = export(CastsInBranches(), x)
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    untaken = ep.graph_module.false_graph_0.graph
    (placeholder,) = untaken.find_nodes(op="placeholder")
    casts = [n for n in untaken.nodes if n.target == aten.to.dtype]
    widened = [n for n in casts if n.args[0] is placeholder]
    assert widened and all(
        n.meta[KEY] == placeholder.meta[KEY] == pytest.approx(float(x.abs().max()))
        and n.meta[CalibrationAnalysis.INTERVAL_KEY]
        == placeholder.meta[CalibrationAnalysis.INTERVAL_KEY]
        for n in widened
    )
    narrowed = [n for n in casts if n.args[0] is not placeholder]
    assert len(narrowed) == 2 and all(KEY not in n.meta for n in narrowed)


class PaddingMask(torch.nn.Module):
    """T5's additive mask: where(keep, 0, finfo.min) added to the scores, then softmax."""

    def forward(self, scores, keep):
        fill = torch.full_like(scores, torch.finfo(torch.float32).min)
        bias = torch.where(keep, torch.zeros_like(scores), fill)
        return (scores + bias).softmax(-1)


def test_a_mask_the_example_does_not_fill_is_still_a_sentinel_fp16_carries():
    """On an all-true mask no value downstream of the fill holds finfo.min, but other
    inputs will: the fill is judged by its uses (where, add, softmax), not flagged as an
    overflow (before: observed inf, kept fp32 with its where and add)."""
    scores, keep = torch.randn(2, 4), torch.ones(2, 4, dtype=torch.bool)
    ep = export(PaddingMask(), scores, keep)
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    magnitudes = {n.name: n.meta.get(KEY) for n in ep.graph_module.graph.nodes}
    assert all(value is None or value < 1e38 for value in magnitudes.values()), magnitudes
    fx16.cast_fp32_to_fp16(ep)
    assert all(
        n.meta[PRECISION].dtype == torch.float16
        for n in ep.graph_module.graph.nodes
        if n.op == "call_function" and PRECISION in n.meta
    )
    padded = torch.tensor([[True, True, False, False]] * 2)
    with torch.no_grad():
        expected = PaddingMask()(scores, padded)
    torch.testing.assert_close(run(ep, scores, padded)[0].float(), expected, atol=2e-3, rtol=0)


def test_a_second_run_replaces_what_the_first_observed():
    """Calibrated on a padded mask, then on an all-true one: the second run's facts
    replace the first's on every node (before: the first run's sentinel stayed, so a
    program cast twice was rewritten as if its mask still held -3.4e38)."""
    scores = torch.randn(2, 4)
    padded = torch.tensor([[True, True, False, False]] * 2)
    ep = export(PaddingMask(), scores, padded)
    bias = _by_target(ep, aten.where.self)
    CalibrationAnalysis(Program(ep), [(scores, padded)])(ep.graph_module)
    assert bias.meta.get(CalibrationAnalysis.SENTINEL_KEY)
    first = {n: n.meta.get(KEY) for n in ep.graph_module.graph.nodes}
    quiet = 1e-3 * scores
    CalibrationAnalysis(Program(ep), [(quiet, torch.ones(2, 4, dtype=torch.bool))])(ep.graph_module)
    assert CalibrationAnalysis.SENTINEL_KEY not in bias.meta
    assert bias.meta[KEY] == 0.0 and first[bias] == 0.0
    added = _by_target(ep, aten.add.Tensor)
    assert first[added] > 0.1  # the unmasked scores
    assert added.meta[KEY] == pytest.approx(quiet.abs().max().item(), rel=1e-6)
    assert added.meta[CalibrationAnalysis.INTERVAL_KEY] == pytest.approx(
        (quiet.min().item(), quiet.max().item()), rel=1e-6
    )


@settings(max_examples=examples(8), deadline=None)
@given(programs(), st.integers(1, 3))
def test_property_views_record_what_reducing_them_would(case, calls):
    """Random programs, several calls: a view, permute or expand records its input's
    observations instead of reducing its own values; what every node records is exactly
    what reducing each value gives."""
    import fx16.analysis.magnitudes as magnitudes

    inputs = [case.inputs(seed) for seed in range(calls)]
    recorded = []
    for shortcut in (True, False):
        ep = case.export()
        original = magnitudes._holds_input_values
        if not shortcut:
            magnitudes._holds_input_values = lambda node: False
        try:
            CalibrationAnalysis(Program(ep), inputs)(ep.graph_module)
        finally:
            magnitudes._holds_input_values = original
        keys = (
            CalibrationAnalysis.META_KEY,
            CalibrationAnalysis.INTERVAL_KEY,
            CalibrationAnalysis.SENTINEL_KEY,
            CalibrationAnalysis.INT_RANGE_KEY,
        )
        recorded.append(
            {
                (module_name, node.name, key): repr(node.meta.get(key))
                for module_name, module in ep.graph_module.named_modules()
                if isinstance(module, torch.fx.GraphModule)
                for node in module.graph.nodes
                for key in keys
            }
        )
    assert recorded[0] == recorded[1]


def _observed_by_definition(tensor: torch.Tensor):
    """(largest, sentinel, interval) as ``observe_floats`` defines them, with whole-tensor
    ops: the finite values below 1e38 count; a finite one at or above it is a sentinel."""
    if not tensor.numel():
        return None, False, None
    magnitude = tensor.abs()
    sentinel = bool(((magnitude >= INF_LIKE) & torch.isfinite(magnitude)).any())
    ordinary = tensor[magnitude < INF_LIKE]
    if not ordinary.numel():
        return None, sentinel, (0, 0)
    return (
        float(magnitude[magnitude < INF_LIKE].max()),
        sentinel,
        (
            float(ordinary.min()),
            float(ordinary.max()),
        ),
    )


_VALUES = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e38, -3.4e38, float("inf"), float("nan"), 7e4, -1e-9]),
)


@settings(max_examples=examples(25), deadline=None)
@given(parts=st.lists(st.lists(_VALUES, max_size=12), min_size=1, max_size=3))
def test_observed_floats_follow_their_definition_for_a_tensor_a_parameter_and_a_tuple(parts):
    """The plain-tensor path, a Parameter, and a tuple of tensors (one reduction each, the
    results combined) all give what the definition gives; nan, inf and sentinels
    included."""
    tensors = [torch.tensor(values, dtype=torch.float32) for values in parts]
    expected = [_observed_by_definition(tensor) for tensor in tensors]
    for tensor, wanted in zip(tensors, expected):
        assert observe_floats(tensor) == wanted
        assert observe_floats(torch.nn.Parameter(tensor, requires_grad=False)) == wanted
    tops = [top for top, _, _ in expected if top is not None]
    intervals = [interval for _, _, interval in expected if interval is not None]
    combined = (
        max(tops) if tops else None,
        any(sentinel for _, sentinel, _ in expected),
        (min(low for low, _ in intervals), max(high for _, high in intervals))
        if intervals
        else None,
    )
    assert observe_floats(tuple(tensors)) == combined


def test_float64_calibration_inputs_are_taken_as_the_float32_the_program_takes():
    """Calibration data in float64 (NumPy's default, through torch.from_numpy) once
    failed inside the program ("mat1 and mat2 must have the same dtype"); it is
    converted as ``inputs_for`` converts a call, and observes what float32 inputs do."""
    torch.manual_seed(0)
    model, x = SquaredSum().eval(), torch.randn(4, 16)  # its squares pass fp16's range
    wide = fx16.cast_fp32_to_fp16(export(model, x), calibration=[(x.double(),)], stabilize=False)
    narrow = fx16.cast_fp32_to_fp16(export(model, x), calibration=[(x,)], stabilize=False)
    decisions = [
        {n.name: n.meta[PRECISION] for n in ep.graph.nodes if PRECISION in n.meta}
        for ep in (wide, narrow)
    ]
    assert decisions[0] == decisions[1]
    assert any(d.reason is Reason.ACTIVATION_OVERFLOW for d in decisions[0].values())


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True, width=32),
            st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 6e-8]),
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_smallest_nonzero_magnitude_is_the_least_nonzero_magnitude(values, dtype):
    """The one-reduction path (all of one sign) and the general one give what the
    definition gives: the least |x| over the nonzero, non-nan elements (inf: none)."""
    tensor = torch.tensor(values, dtype=torch.float32).to(dtype)
    magnitudes = [abs(v) for v in tensor.tolist() if v == v and v != 0]
    assert smallest_nonzero_magnitude(tensor) == min(magnitudes, default=math.inf)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(allow_nan=True, allow_infinity=True, width=32),
            st.floats(min_value=1e-3, max_value=1e3),
            st.sampled_from([0.0, 1e-45, -1e-45, 6e-8, 1e38, -1e38, 3.4e38, -3.4e38]),
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_calibration_records_the_least_nonzero_magnitude_of_a_watched_value(values, dtype):
    """What calibration records of a watched value (read from the run's own reduction
    where the values are of one sign, past sentinels and infinities) is the least |x|
    over its nonzero, non-nan elements, for the value an op makes and for an input."""
    graph_module = torch.fx.symbolic_trace(lambda x: torch.ops.aten.mul.Tensor(x, 1.0))
    watched = {node for node in graph_module.graph.nodes if node.op != "output"}
    recorder = MagnitudeRecorder(graph_module, watched=watched)
    tensor = torch.tensor(values, dtype=torch.float32).to(dtype)
    recorder.run(tensor)
    magnitudes = [abs(v) for v in tensor.tolist() if v == v and v != 0]
    for node in watched:
        assert recorder.smallest.get(node, math.inf) == min(magnitudes, default=math.inf)
