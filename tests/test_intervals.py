"""fx16.analysis.intervals: integer ranges and their sources, with the expected values
written out."""

import math

import pytest
import sympy
import torch
from torch.export import Dim
from torch.utils._sympy.numbers import int_oo

import fx16
from fx16 import meta
from fx16.analysis.intervals import (
    Source,
    ValueRange,
    _bound,
    add_ranges,
    multiply,
    size_range,
    span,
    union,
    value_range,
)
from fx16.ops.numerics import finite_interval
from helpers import run

PROVEN, DECLARED, OBSERVED = Source.PROVEN, Source.DECLARED, Source.OBSERVED


def test_union_spans_its_parts_and_takes_the_weakest_source():
    parts = [ValueRange(0, 1, PROVEN), ValueRange(-2, 0, DECLARED)]
    assert union(parts) == ValueRange(-2, 1, DECLARED)
    assert union([ValueRange(3, 4, OBSERVED), ValueRange(5, 9, PROVEN)]) == ValueRange(
        3, 9, OBSERVED
    )
    assert union([]) is None
    assert union([ValueRange(0, 1, PROVEN), None]) is None


def test_arithmetic_on_ranges():
    a, b = ValueRange(-3, 2, PROVEN), ValueRange(4, 5, DECLARED)
    assert multiply(a, b) == ValueRange(-15, 10, DECLARED)
    assert add_ranges(a, b) == ValueRange(1, 7, DECLARED)
    assert add_ranges(a, b, sign=-1) == ValueRange(-8, -2, DECLARED)
    assert multiply(ValueRange(0, 0, PROVEN), ValueRange(-math.inf, math.inf, PROVEN)) == (
        ValueRange(0, 0, PROVEN)
    )
    assert span(math.nan, 1) is None and span(0, 1, None) is None


def test_a_range_reads_as_its_bounds_and_source():
    assert str(ValueRange(-32768, 32767, PROVEN)) == "[-32768, 32767] (proven)"
    assert str(ValueRange(-math.inf, math.inf, OBSERVED)) == "[-inf, inf] (observed)"


class PositionsAdded(torch.nn.Module):
    """x + arange(len(x)): a size that becomes a value."""

    def forward(self, x):
        return x + torch.arange(x.shape[0]).unsqueeze(1)


@pytest.mark.parametrize("maximum", [None, 64], ids=["unbounded", "bounded"])
def test_a_dynamic_size_has_the_range_its_constraint_gives(maximum):
    """Dim("b") has no upper bound (torch's int_oo, which calls itself finite): the
    range's top is inf, and the program casts (it failed with an AttributeError)."""
    dim = Dim("b") if maximum is None else Dim("b", min=2, max=maximum)
    ep = torch.export.export(PositionsAdded(), (torch.randn(4, 8),), dynamic_shapes=({0: dim},))
    (x,) = [n for n in ep.graph.nodes if n.op == "placeholder"]
    found = size_range(x.meta["val"].shape[0], ep.range_constraints)
    assert found.high == (math.inf if maximum is None else maximum)
    assert size_range(8, ep.range_constraints) == ValueRange(8, 8, PROVEN)
    fx16.cast_to_16_bit_precision(ep)
    x = torch.randn(9, 8)
    torch.testing.assert_close(run(ep, x)[0].float(), PositionsAdded()(x), rtol=2e-3, atol=2e-3)


def test_a_finite_interval_leaves_infinities_out():
    assert finite_interval(torch.tensor([1.0, 2.0, math.inf])) == (1.0, 2.0)
    assert finite_interval(torch.tensor([-math.inf, -1.0, 3.0])) == (-1.0, 3.0)


def test_a_range_takes_its_weakest_source_from_either_side():
    a, b = ValueRange(0, 1, DECLARED), ValueRange(2, 3, PROVEN)
    assert add_ranges(a, b) == ValueRange(2, 4, DECLARED)
    assert multiply(a, b) == ValueRange(0, 3, DECLARED)
    assert span(0, 1) == ValueRange(0, 1, PROVEN)  # no parts: what is computed is proven


def test_numbers_and_bounds_as_ranges():
    assert value_range(True) == ValueRange(1, 1, PROVEN)
    assert value_range(7) == ValueRange(7, 7, PROVEN)
    assert value_range(0.5) is None
    assert _bound(-int_oo) == -math.inf and _bound(-sympy.oo) == -math.inf
    assert _bound(int_oo) == math.inf and _bound(sympy.Integer(5)) == 5


def test_a_node_has_a_range_only_when_it_recorded_a_single_one():
    """A multi-output op (sort: values and indices) records a tuple of ranges, one per
    output: the node itself has no single range; its getitems have theirs."""
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    each = (ValueRange(-5, 5, PROVEN), ValueRange(0, 7, PROVEN))
    node.meta[meta.PROVEN_RANGE] = each
    assert value_range(node) is None
    node.meta[meta.PROVEN_RANGE] = each[1]
    assert value_range(node) == ValueRange(0, 7, PROVEN)
    del node.meta[meta.PROVEN_RANGE]
    assert value_range(node) is None


def test_a_bounded_dynamic_size_has_both_ends():
    dim = Dim("b", min=2, max=64)
    ep = torch.export.export(PositionsAdded(), (torch.randn(4, 8),), dynamic_shapes=({0: dim},))
    (x,) = [n for n in ep.graph.nodes if n.op == "placeholder"]
    assert size_range(x.meta["val"].shape[0], ep.range_constraints) == ValueRange(2, 64, PROVEN)
