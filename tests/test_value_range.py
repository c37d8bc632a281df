"""ValueRangeAnalysis: intervals for integer values, and that they always hold."""

import pytest
import torch
import torch.utils._pytree as pytree
from fuzz_profile import examples
from hypothesis import HealthCheck, given, settings

from fx16.analysis import CalibrationAnalysis, Source, ValueRange, ValueRangeAnalysis, value_range
from fx16.errors import InvalidOptionError
from fx16.program import Program
from fx16.program.subgraphs import nested_graph_modules
from fx16.testing.strategies import integer_cases, programs
from helpers import export
from models import BucketHash, CumsumCounter, GatherComputedIndex, PositionsAndMask

KEY = ValueRangeAnalysis.META_KEY


def _analyse(ep, input_ranges=None):
    code = ep.graph_module.code
    assert not ValueRangeAnalysis(Program(ep), input_ranges)(ep.graph_module).modified
    assert ep.graph_module.code == code
    return {n.name: n.meta.get(KEY) for n in ep.graph_module.graph.nodes}


def test_declared_ranges_flow_through_arithmetic():
    """ids:[0,999] -> mul(1000):[0,999000] -> add(ids):[0,999999] -> remainder(97):[0,96]."""
    ranges = _analyse(export(BucketHash(), torch.arange(5)), {"ids": (0, 999)})
    assert ranges["ids"] == ValueRange(0, 999, Source.DECLARED)
    assert ranges["mul"] == ValueRange(0, 999000, Source.DECLARED)
    assert ranges["add"] == ValueRange(0, 999999, Source.DECLARED)
    assert ranges["remainder"] == ValueRange(0, 96, Source.PROVEN)


def test_unknown_inputs_leave_ranges_unknown():
    ranges = _analyse(export(BucketHash(), torch.arange(5)))
    assert ranges["ids"] is None and ranges["add"] is None
    assert ranges["remainder"] == ValueRange(0, 96, Source.PROVEN)


def test_shapes_bounded_by_range_constraints():
    """Dim(max=64): sym_size in [0, 64], arange in [0, 63], mask cumsum in [0, 64]."""
    length = torch.export.Dim("length", max=64)
    args = (torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.bool))
    ep = export(PositionsAndMask(), *args, dynamic_shapes=({1: length}, {1: length}))
    ranges = _analyse(ep)
    assert ranges["sym_size_int_1"].high == 64
    assert ranges["arange"] == ValueRange(0, 63, Source.PROVEN)
    assert ranges["mask"] == ValueRange(0, 1, Source.PROVEN)
    assert ranges["cumsum"] == ValueRange(0, 64, Source.PROVEN)
    assert ranges["sub"] == ValueRange(-1, 63, Source.PROVEN)
    assert ranges["clamp"] == ValueRange(0, 63, Source.PROVEN)


def test_cumsum_scales_with_the_sequence_length():
    length = torch.export.Dim("length", max=4096)
    args = (torch.ones(1, 8, dtype=torch.int64), torch.ones(1, 8, dtype=torch.int64))
    ep = export(CumsumCounter(), *args, dynamic_shapes=({1: length}, {1: length}))
    ranges = _analyse(ep, {"steps": (0, 10), "offset": (0, 1)})
    assert ranges["cumsum"] == ValueRange(0, 11 * 4096, Source.DECLARED)
    assert not ranges["cumsum"].fits(torch.int16)


class Bounded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.tensor([3, -5, 7]))
        self.register_buffer("edges", torch.tensor([0.0, 1.0, 2.0, 3.0]))

    def forward(self, x, scores):
        picked = scores.argmax(-1)
        top = scores.topk(2, -1).indices
        buckets = torch.bucketize(scores, self.edges)
        flags = (x > 3).long()
        return picked + top[..., 0], buckets, flags * self.table, x.abs().neg()


def test_bounded_ops_constants_and_comparisons():
    ranges = _analyse(export(Bounded(), torch.tensor([1, -2, 9]), torch.randn(3, 5)))
    assert ranges["b_table"] == ValueRange(-5, 7, Source.PROVEN)
    assert ranges["argmax"] == ValueRange(0, 4, Source.PROVEN)
    assert ranges["getitem_1"] == ValueRange(0, 4, Source.PROVEN)
    assert ranges["bucketize"] == ValueRange(0, 4, Source.PROVEN)
    assert ranges["gt"] == ValueRange(0, 1, Source.PROVEN)
    assert ranges["mul"] == ValueRange(-5, 7, Source.PROVEN)
    assert ranges["abs_1"] is None  # x has no declared range


def test_input_range_names_are_checked():
    with pytest.raises(InvalidOptionError, match="not user inputs.*'ids'"):
        _analyse(export(BucketHash(), torch.arange(5)), {"input_ids": (0, 10)})


class _Observer(torch.fx.Interpreter):
    """Runs the graph and checks every integer value against its recorded range."""

    def run_node(self, node):
        result = super().run_node(node)
        recorded = node.meta.get(KEY)
        values = pytree.tree_leaves(result)
        ranges = recorded if isinstance(recorded, tuple) else [recorded] * len(values)
        for value, found in zip(values, ranges):
            if isinstance(value, torch.Tensor) and found is not None and value.numel():
                if not value.is_floating_point():
                    low, high = int(value.min()), int(value.max())
                    assert found.low <= low and high <= found.high, (node.name, found, low, high)
        return result


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(integer_cases())
def test_recorded_ranges_contain_every_value_seen(case):
    model, args, input_ranges, draw_inputs = case
    ep = export(model, *args)
    _analyse(ep, input_ranges)
    for seed in range(3):
        inputs = Program(ep).graph_inputs(draw_inputs(seed))
        _Observer(ep.graph_module).run(*inputs)


def test_calibration_ranges_are_marked_observed():
    ep = export(BucketHash(), torch.tensor([4, 10]))
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    ranges = _analyse(ep)
    assert ranges["ids"] == ValueRange(4, 10, Source.OBSERVED)
    assert ranges["mul"] == ValueRange(4000, 10000, Source.OBSERVED)
    assert ranges["remainder"].source == Source.PROVEN


@pytest.mark.parametrize("decompose", [False, True])
def test_arange_in_every_overload(decompose):
    """arange(n), arange(a, b) and the decomposed arange.start_step with its default step."""

    class Ranges(torch.nn.Module):
        def forward(self, x):
            n = x.shape[0]
            return torch.arange(n) + torch.arange(2, n + 2) + x

    length = torch.export.Dim("length", max=100)
    ep = export(Ranges(), torch.arange(4), dynamic_shapes=({0: length},), decompose=decompose)
    ranges = _analyse(ep)
    found = sorted(
        (r.low, r.high) for n, r in ranges.items() if n.startswith("arange") and r is not None
    )
    assert found == [(0, 99), (2, 101)]


def _every_range(ep) -> dict:
    return {
        (index, node.name): node.meta.get(KEY)
        for index, module in enumerate(nested_graph_modules(ep.graph_module))
        for node in module.graph.nodes
    }


def _with_full_second_walk(ep) -> dict:
    """The ranges when the walk after the index bounds redoes every node."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(value_range, "_downstream", lambda confined: None)
        _analyse(ep)
    return _every_range(ep)


@pytest.mark.parametrize(
    "model, args",
    [
        (PositionsAndMask(), (torch.tensor([[3, 7, 1]]), torch.tensor([[1, 1, 0]]))),
        (GatherComputedIndex(), (torch.randn(2, 5), torch.tensor([[1, 2], [3, 4]]))),
    ],
)
def test_the_walk_after_index_bounds_redoes_only_what_they_reach(monkeypatch, model, args):
    """Index bounds (an index must lie inside the table) confine some integer values;
    the second walk then visits only the nodes those reach and ends with the ranges a
    walk over every node gives - here with a bound that changes a downstream range."""
    ep = export(model, *args)
    walked = []
    forward = value_range._Walk.forward

    def counting(self, graph_module, confined, reached=None):
        walked.append((bool(confined), reached))
        return forward(self, graph_module, confined, reached)

    monkeypatch.setattr(value_range._Walk, "forward", counting)
    incremental = _analyse(ep)
    monkeypatch.undo()
    (_, reached), *_ = [entry for entry in walked if entry[0]]  # a second walk ran
    assert reached is not None and 0 < len(reached) < len(ep.graph_module.graph.nodes)
    full = _with_full_second_walk(export(model, *args))
    assert _every_range(ep) == full
    confined = [n for n in reached if incremental.get(n.name) is not None]
    assert confined  # the bounds gave ranges the first walk did not have


@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_the_incremental_walk_equals_a_full_walk_on_random_programs(case):
    """On programs of the fuzzer's whole menu (embeddings indexed by computed ids,
    bodies of higher-order ops), the walk limited to what the index bounds reach gives
    every node the range a full second walk gives (the analysis rewrites every range
    it walks, so both run on one program)."""
    ep = case.export()
    _analyse(ep)
    incremental = _every_range(ep)
    assert incremental == _with_full_second_walk(ep)
