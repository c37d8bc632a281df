"""Cancellation inside ops that subtract a mean (batch/layer/group/instance norms, var,
std) and in a subtraction of a per-slice statistic (``x - x.mean(0, keepdim=True)``).

The conditioning rule measures their input's cancellation ratio (max |x| / max |x -
mean| per group or slice) on calibration, or a batch norm's from its running statistics.
Unseen inputs lie further from zero than the calibration inputs.
"""

import math

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from benchmarks.precision_zoo import (
    TABULAR_MEANS,
    TABULAR_SPREADS,
    NormOfOffsetData,
    SpreadOfOffsetData,
    Standardized,
    TabularBatchNorm,
    offset_features,
)
from benchmarks.shift_traps import MixedColumns, mixed_columns
from fx16.analysis import CalibrationAnalysis, ConditioningAnalysis, ValueRangeAnalysis
from fx16.analysis.centering import (
    Centered,
    buffer_ratio,
    cancellation_ratio,
    centered_input,
    running_statistics,
)
from fx16.decisions import PRECISION, Reason
from fx16.program import Program
from helpers import check_program, export, fp64_reference, max_error, run

KEY = ConditioningAnalysis.META_KEY


def _marks(ep, calibration=None):
    program = Program(ep)
    CalibrationAnalysis(program, calibration)(ep.graph_module)
    ValueRangeAnalysis(program)(ep.graph_module)
    ConditioningAnalysis(program)(ep.graph_module)
    return {node.name: node.meta.get(KEY) for node in ep.graph_module.graph.nodes}


def test_the_ratio_is_one_for_centred_data_and_mean_over_spread_for_offset_data():
    generator = torch.Generator().manual_seed(0)
    centred = torch.randn(64, 32, generator=generator)
    assert cancellation_ratio(Centered(centred, (1,))) < 1.5
    offset = 3000 + 2 * centred
    assert 300 < cancellation_ratio(Centered(offset, (1,))) < 1500
    against = Centered(offset, (0,), torch.full((32,), 3000.0))  # the center given
    assert cancellation_ratio(against) == pytest.approx(
        cancellation_ratio(Centered(offset, (0,))), rel=0.2
    )
    assert cancellation_ratio(Centered(torch.ones(4, 8), (1,))) == 1.0  # nothing deviates


def test_each_op_says_what_it_centres():
    x = torch.randn(2, 8, 5)
    aten = torch.ops.aten
    layer = centered_input(aten.layer_norm.default, (x, [5]))
    assert layer.dims == (2,) and layer.center is None
    group = centered_input(aten.group_norm.default, (x, 4))
    assert group.values.shape == (2, 4, 10) and group.dims == (2,)
    mean = torch.arange(8.0)
    batch = centered_input(aten.batch_norm.default, (x, None, None, mean, mean, False))
    assert batch.dims == (0, 2) and batch.center.shape == (1, 8, 1)
    assert centered_input(aten.var.correction, (x, [1])).dims == (1,)
    assert centered_input(aten.relu.default, (x,)) is None
    assert buffer_ratio(torch.tensor([4000.0, 0.0]), torch.tensor([4.0, 1.0])) == pytest.approx(
        2000, rel=1e-3
    )


def test_a_batch_norm_on_offset_features_is_kept_with_its_input():
    """x (user input) -> batch_norm (running_mean 1000-5000) -> mlp: the batch norm and
    the input are marked, the mlp's linears are not."""
    ep = export(TabularBatchNorm(), offset_features(64, TABULAR_MEANS, TABULAR_SPREADS, 1))
    marks = _marks(ep)
    norm = next(name for name in marks if "batch_norm" in name)
    assert "cancellation inside" in marks[norm] and "(observed)" in marks[norm]
    assert marks["x"] == f"feeds {norm}, kept in fp32"
    assert marks["linear"] is None and marks["linear_1"] is None


def test_without_calibration_a_batch_norm_reads_its_running_statistics():
    ep = export(TabularBatchNorm(), offset_features(64, TABULAR_MEANS, TABULAR_SPREADS, 1))
    marks = _marks(ep, calibration=[])
    norm = next(name for name in marks if "batch_norm" in name)
    assert "from its running statistics" in marks[norm]


def test_centred_data_is_left_alone():
    """A layer norm of centred activations (any transformer's) keeps nothing fp32."""
    torch.manual_seed(0)
    ep = export(NormOfOffsetData("layer"), torch.randn(8, 16))
    assert not any(_marks(ep).values())


CASES = {
    "batch norm": (TabularBatchNorm, TABULAR_MEANS, TABULAR_SPREADS, 1.2),
    "standardized by buffers": (Standardized, TABULAR_MEANS, TABULAR_SPREADS, 1.1),
    "layer norm": (
        lambda: NormOfOffsetData("layer"),
        torch.full((16,), 3000.0),
        torch.full((16,), 2.0),
        1.5,
    ),
    "group norm": (
        lambda: NormOfOffsetData("group"),
        torch.full((64,), 3000.0),
        torch.full((64,), 2.0),
        1.5,
    ),
    "instance norm": (
        lambda: NormOfOffsetData("instance"),
        torch.full((64,), 3000.0),
        torch.full((64,), 2.0),
        1.5,
    ),
    "std": (SpreadOfOffsetData, torch.full((64,), 100.0), torch.ones(64), 1.2),
    "E[x^2] - E[x]^2": (
        lambda: SpreadOfOffsetData(by_hand=True),
        torch.full((64,), 100.0),
        torch.ones(64),
        1.2,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_offset_data_is_accurate_on_unseen_inputs_further_out(case):
    """Calibrated at the example's offset, run at a larger one: within 3e-3 of fp64,
    with no nan (the hand-written variance goes negative in fp16), and every product
    still in 16-bit."""
    build, means, spreads, further = CASES[case]
    torch.manual_seed(0)
    model = build().eval()
    ep = fx16.cast_fp32_to_fp16(export(model, offset_features(64, means, spreads, 1)))
    check_program(ep)
    unseen = offset_features(64, means * further, spreads, 2)
    got = run(ep, unseen)
    assert all(torch.isfinite(out).all() for out in got)
    assert max_error(fp64_reference(model, unseen), got) < 3e-3
    rows = fx16.report.report_of(ep).rows
    assert {row.rule for row in rows if not row.narrowed} == {"ill_conditioned"}
    assert all(row.narrowed for row in rows if row.product)
    user_input = next(node for node in ep.graph_module.graph.nodes if node.name == "x")
    assert user_input.meta[PRECISION].reason == Reason.ILL_CONDITIONED
    assert user_input.meta["val"].dtype == torch.float32  # the cancelling operand stays fp32


@settings(max_examples=examples(12), deadline=None)
@given(st.floats(0.0, 5000.0), st.floats(0.5, 5.0), st.integers(0, 2**16))
def test_property_a_layer_norm_is_accurate_at_any_offset(offset, spread, seed):
    """Offset 0 to 5000, spread 0.5 to 5 (narrower spreads at 5000 lose accuracy in
    fp32 itself): the output is within 3e-3 of fp64 on another input at that offset."""
    torch.manual_seed(seed)
    model = NormOfOffsetData("layer").eval()
    means, spreads = torch.full((16,), offset), torch.full((16,), spread)
    ep = fx16.cast_fp32_to_fp16(export(model, offset_features(32, means, spreads, seed)))
    unseen = offset_features(32, means, spreads, seed + 1)
    assert max_error(fp64_reference(model, unseen), run(ep, unseen)) < 3e-3


# ---- a subtraction of a per-slice statistic ----------------------------------------------


def test_a_subtraction_of_a_broadcast_statistic_is_centred_per_slice():
    """x - mean over dim 0 centres each column, x - mean over dim -1 each row; a
    subtraction of same-shaped tensors, of a scalar, or broadcast along every dim is
    the whole-tensor rule's."""
    sub = torch.ops.aten.sub.Tensor
    x = torch.randn(6, 4, 5)
    assert centered_input(sub, (x, x.mean(0, keepdim=True))).dims == (0,)
    assert centered_input(sub, (x, x.mean((0, 2), keepdim=True))).dims == (0, 2)
    assert centered_input(sub, (x, x.amax(-1, keepdim=True))).dims == (2,)
    assert centered_input(sub, (x.mean(-1, keepdim=True), x)).dims == (2,)  # mean - x
    assert centered_input(sub, (x[0], x.mean(0))) is None  # same shape
    assert centered_input(sub, (x, 1.0)) is None
    assert centered_input(sub, (x[:, :1, :1], x[:1, :, :1])) is None  # every dim: whole


@settings(max_examples=examples(20), deadline=None)
@given(
    st.lists(st.floats(-5000, 5000), min_size=2, max_size=6),
    st.lists(st.floats(0.01, 100), min_size=6, max_size=6),
    st.integers(0, 2**16),
)
def test_property_the_per_slice_ratio_is_the_worst_columns(means, spreads, seed):
    """Against a loop over the columns: each column's max |x| / max |x - its mean|,
    the largest of them (a constant column left out)."""
    columns = len(means)
    x = offset_features(16, torch.tensor(means), torch.tensor(spreads[:columns]), seed)
    x[:, -1] = means[-1]  # a constant column
    mean = x.mean(0, keepdim=True)
    expected = max(
        [
            float(x[:, j].abs().max() / (x[:, j] - mean[0, j]).abs().max())
            for j in range(columns - 1)
        ]
        + [1.0]
    )
    got = cancellation_ratio(centered_input(torch.ops.aten.sub.Tensor, (x, mean)))
    assert got == pytest.approx(expected, rel=1e-4)


def test_a_narrow_column_beside_wide_ones_is_kept_and_holds_on_unseen_rows():
    """Standardizing columns of different units: the whole tensor's ratio is the wide
    columns' (below the rule's 8), the narrow column's about 900; the subtraction and
    the mean it reads stay fp32, the product stays 16-bit, and unseen rows come out
    within 3e-3 of fp64 (about 0.1 off before the per-slice rule)."""
    torch.manual_seed(0)
    model = MixedColumns().eval()
    example = mixed_columns(64, seed=1)
    mean = example.mean(0, keepdim=True)
    assert float(example.abs().max() + mean.abs().max()) / float((example - mean).abs().max()) < 8
    marks = _marks(export(model, example))
    assert "a - b per slice" in marks["sub"] and "(observed" in marks["sub"]
    assert marks["mean"] == "feeds sub, kept in fp32" and marks["linear"] is None
    ep = fx16.cast_fp32_to_fp16(export(model, example))
    check_program(ep)
    assert all(row.narrowed for row in fx16.report.report_of(ep).rows if row.product)
    unseen = mixed_columns(64, seed=2)
    assert max_error(fp64_reference(model, unseen), run(ep, unseen)) < 3e-3


class MixedColumnsInABody(torch.nn.Module):
    """The per-column standardization inside a ``torch.no_grad()`` body."""

    def forward(self, x):
        with torch.no_grad():
            return (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)


def test_a_narrow_column_is_judged_per_slice_inside_a_body_too():
    ep = export(MixedColumnsInABody(), mixed_columns(64, seed=1))
    program = Program(ep)
    CalibrationAnalysis(program)(ep.graph_module)
    ValueRangeAnalysis(program)(ep.graph_module)
    ConditioningAnalysis(program)(ep.graph_module)
    marks = [
        node.meta.get(KEY)
        for module in ep.graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.target == torch.ops.aten.sub.Tensor
    ]
    assert marks and all(mark and "a - b per slice" in mark for mark in marks)


# ---- each layout, pinned: what every op centres, from its real arguments -------------

aten = torch.ops.aten
X3 = torch.arange(2 * 8 * 5, dtype=torch.float32).reshape(2, 8, 5)
X4 = torch.arange(2 * 8 * 3 * 5, dtype=torch.float32).reshape(2, 8, 3, 5)
MEAN8, VAR8 = torch.arange(8.0), torch.full((8,), 4.0)


@pytest.mark.parametrize(
    ("target", "args", "values_shape", "dims", "center"),
    [
        (aten.layer_norm.default, (X3, [5]), (2, 8, 5), (2,), None),
        (aten.layer_norm.default, (X3, [8, 5]), (2, 8, 5), (1, 2), None),
        (
            aten.native_layer_norm.default,
            (X4, [3, 5], None, None, 1e-5),
            (2, 8, 3, 5),
            (2, 3),
            None,
        ),
        (aten.group_norm.default, (X4, 2), (2, 2, 60), (2,), None),
        (
            aten.native_group_norm.default,
            (X4, None, None, 2, 8, 15, 4, 1e-5),
            (2, 4, 30),
            (2,),
            None,
        ),
        (
            aten.batch_norm.default,
            (X4, None, None, MEAN8, VAR8, False),
            (2, 8, 3, 5),
            (0, 2, 3),
            "mean",
        ),
        (aten.batch_norm.default, (X3, None, None, MEAN8, VAR8, True), (2, 8, 5), (0, 2), None),
        (aten.batch_norm.default, (X3, None, None, None, None, False), (2, 8, 5), (0, 2), None),
        (aten.batch_norm.default, (X3, None, None, MEAN8, VAR8), (2, 8, 5), (0, 2), "mean"),
        (
            aten._native_batch_norm_legit.default,
            (X3, None, None, MEAN8, VAR8, False, 0.1, 1e-5),
            (2, 8, 5),
            (0, 2),
            "mean",
        ),
        (
            aten._native_batch_norm_legit_no_training.default,
            (X4, None, None, MEAN8, VAR8, 0.1, 1e-5),
            (2, 8, 3, 5),
            (0, 2, 3),
            "mean",
        ),
        (
            aten._native_batch_norm_legit.no_stats,
            (X3, None, None, True, 0.1, 1e-5),
            (2, 8, 5),
            (0, 2),
            None,
        ),
        (
            aten.instance_norm.default,
            (X4, None, None, None, None, True, 0.1, 1e-5, False),
            (2, 8, 3, 5),
            (2, 3),
            None,
        ),
        (aten.var.correction, (X3, [1]), (2, 8, 5), (1,), None),
        (aten.var.correction, (X3, [-1, 0]), (2, 8, 5), (2, 0), None),
        (aten.var.correction, (X3, None), (2, 8, 5), (0, 1, 2), None),
        (aten.var.correction, (X3,), (2, 8, 5), (0, 1, 2), None),
        (aten.var.dim, (X3, -2), (2, 8, 5), (1,), None),
        (aten.var_mean.correction, (X3, [2]), (2, 8, 5), (2,), None),
        (aten.std.correction, (torch.tensor(3.0), None), (), (), None),
        (aten.var.correction, (torch.tensor(3.0), [0]), (), (), None),  # a 0-d input's dim 0
        (aten.sub.Tensor, (X3, X3.mean(0, keepdim=True)), (2, 8, 5), (0,), "b"),
        (aten.sub.Tensor, (X3, X3.amax(-1, keepdim=True)), (2, 8, 5), (2,), "b"),
        (
            aten.sub.Tensor,
            (X3, X3[0, :, 0]),
            (2, 8, 5),
            None,
            None,
        ),  # (8,) against (2, 8, 5): not broadcastable
        (aten.sub.Tensor, (X3.reshape(2, 40), X3.reshape(2, 40)[:1]), (2, 40), (0,), "b"),
        (aten.sub.Tensor, (X3, X3.mean((0, 1), keepdim=True)), (2, 8, 5), (0, 1), "b"),
    ],
    ids=lambda value: str(value) if isinstance(value, torch._ops.OpOverload) else None,
)
def test_each_layout_names_its_groups_and_center(target, args, values_shape, dims, center):
    if dims is None:
        with pytest.raises(RuntimeError):
            centered_input(target, args)
        return
    centered = centered_input(target, args)
    assert tuple(centered.values.shape) == values_shape
    assert centered.dims == dims
    if center is None:
        assert centered.center is None
    elif center == "mean":
        shape = [1, 8] + [1] * (args[0].dim() - 2)
        assert centered.center.shape == tuple(shape) and torch.equal(
            centered.center.flatten(), MEAN8
        )
    else:
        assert torch.equal(
            torch.broadcast_to(centered.center, values_shape),
            torch.broadcast_to(args[1], values_shape),
        )
    source = args[0]
    same_elements = source.numel() == math.prod(values_shape)
    expected = source.reshape(values_shape) if same_elements else source.expand(values_shape)
    assert torch.equal(centered.values, expected)


@pytest.mark.parametrize(
    ("target", "args"),
    [
        (aten.sub.Tensor, (X3, X3)),  # the same shape: no statistic
        (aten.sub.Tensor, (X3, 2.0)),  # a scalar
        (aten.sub.Tensor, (X3, torch.tensor(2.0))),  # one slice: the whole tensor
        (aten.sub.Tensor, (X3[:1, :1], X3[:1, :1, :1])),  # (1, 1, 5) - (1, 1, 1): one slice
        (aten.relu.default, (X3,)),
        (aten.layer_norm.default, (torch.arange(6).reshape(2, 3), [3])),  # integers
        (aten.layer_norm.default, (None, [3])),
    ],
)
def test_an_op_without_a_centred_float_input_has_no_layout(target, args):
    assert centered_input(target, args) is None


def test_running_statistics_are_read_only_in_inference():
    stats = (MEAN8, VAR8)
    inference = aten._native_batch_norm_legit_no_training.default
    got = running_statistics(inference, (X3, None, None, *stats, 0.1, 1e-5))
    assert got[0] is MEAN8 and got[1] is VAR8
    for target in (
        aten.batch_norm.default,
        aten.native_batch_norm.default,
        aten._native_batch_norm_legit.default,
    ):
        got = running_statistics(target, (X3, None, None, *stats, False, 0.1, 1e-5))
        assert got[0] is MEAN8 and got[1] is VAR8
        assert running_statistics(target, (X3, None, None, *stats, True, 0.1, 1e-5)) is None
        assert running_statistics(target, (X3, None, None, *stats)) is None
        got = running_statistics(target, (X3, None, None, *stats, False))  # training last
        assert got[0] is MEAN8 and got[1] is VAR8
    assert running_statistics(aten.layer_norm.default, (X3, [5], None, None, 1e-5, False)) is None


def test_the_cancellation_ratio_pins_its_threshold_and_edge_cases():
    assert cancellation_ratio(Centered(torch.tensor([[1000.0, 1001.0]]), (1,))) == pytest.approx(
        2002
    )
    # the center given instead of the mean: max |x| / max |x - center|
    given = Centered(torch.tensor([[10.0, 12.0]]), (1,), torch.tensor([[8.0]]))
    assert cancellation_ratio(given) == pytest.approx(12 / 4)
    # a deviation within 16 of fp32's roundings of the largest magnitude is constant
    within = torch.tensor([[1.0, 1.0 + 2.0**-19]])
    beyond = torch.tensor([[1.0, 1.0 + 2.0**-16]])
    assert cancellation_ratio(Centered(within, (1,))) == 1.0
    assert cancellation_ratio(Centered(beyond, (1,))) == pytest.approx(2.0**17, rel=1e-3)
    # the worst group counts, not the first or an average of them
    groups = torch.tensor([[0.0, 2.0], [100.0, 102.0], [5.0, 7.0]])
    assert cancellation_ratio(Centered(groups, (1,))) == pytest.approx(102)
    assert cancellation_ratio(Centered(torch.empty(0, 3), (1,))) == 1.0
    assert cancellation_ratio(Centered(groups, ())) == 1.0
    assert cancellation_ratio(Centered(torch.tensor([[float("inf"), 1.0]]), (1,))) == 1.0
    assert cancellation_ratio(Centered(groups.half(), (1,))) == pytest.approx(102)


def test_the_buffer_ratio_is_the_largest_mean_over_its_deviation():
    assert buffer_ratio(torch.tensor([3.0]), torch.tensor([0.0])) == pytest.approx(3 / 1e-5**0.5)
    assert buffer_ratio(torch.tensor([3.0, -8.0]), torch.tensor([9.0, 16.0]), eps=0.0) == 2.0
    assert buffer_ratio(torch.empty(0), torch.empty(0)) == 1.0
