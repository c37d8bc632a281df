"""fx16.analysis.upstream: what an op's input is computed from, elementwise."""

import torch
from torch import nn

from fx16.analysis import CalibrationAnalysis, ValueRangeAnalysis
from fx16.analysis.float_range import FloatRanges
from fx16.analysis.upstream import elementwise_past
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from helpers import export, node_named


def _past(ep, seed_name, **options):
    program = Program(ep)
    CalibrationAnalysis(program)(ep.graph_module)
    ValueRangeAnalysis(program)(ep.graph_module)
    ranges = FloatRanges(program)
    seed = node_named(ep, seed_name)
    return [
        n.name for n in elementwise_past(seed, Boundaries(ep.graph_module), ranges.of, **options)
    ]


class HandVariance(nn.Module):
    """fc -> (h * h).mean - h.mean ** 2."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x) + 100.0
        return (h * h).mean(-1) - h.mean(-1) ** 2


def test_the_walk_goes_through_reductions_and_stops_before_the_product():
    """sub <- mean(mul(h, h)), pow(mean(h)); h = add(linear, 100): all but the linear."""
    past = _past(export(HandVariance(), torch.randn(4, 8)), "sub")
    assert set(past) == {"mean", "mul", "add", "mean_1", "pow_1"}
    assert "linear" not in past and "x" not in past


class Rotary(nn.Module):
    """sin(inv_freq @ positions): a product of state and sizes, with a proven range."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.rand(8, 1))

    def forward(self, x):
        positions = torch.arange(x.shape[-1]).float()[None, :]
        return x + torch.sin(self.inv_freq @ positions)


def test_a_product_with_a_proven_range_is_walked_through():
    past = _past(export(Rotary(), torch.randn(8, 16)), "sin")
    assert {"matmul", "b_inv_freq", "to"} <= set(past)


def test_the_walk_starts_where_it_is_told():
    """Only the divisor's past: x / (y + 1)."""

    class Divide(nn.Module):
        def forward(self, x, y):
            return x / (y + 1)

    ep = export(Divide(), torch.randn(2, 4), torch.randn(2, 4))
    assert _past(ep, "div", reads=[node_named(ep, "add")]) == ["add", "y"]


def test_the_walk_is_bounded():
    past = _past(export(HandVariance(), torch.randn(4, 8)), "sub", limit=2)
    assert len(past) == 2
