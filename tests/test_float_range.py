"""FloatRanges: proven intervals of floats made from integers, sizes, constants and state."""

import math

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fx16.analysis import ValueRangeAnalysis
from fx16.analysis.float_range import FloatRanges
from fx16.program import Program
from fx16.program.interpreter import LeanInterpreter
from helpers import export


def _ranges(ep):
    program = Program(ep)
    ValueRangeAnalysis(program, {"t": (0, 999)} if "t" in _names(ep) else None)(ep.graph_module)
    ranges = FloatRanges(program)
    found = {}
    for node in ep.graph_module.graph.nodes:
        r = ranges.of(node)
        found[node.name] = None if r is None else (r.low, r.high)
    return found


def _names(ep):
    return {node.name for node in ep.graph_module.graph.nodes}


class Timestep(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.tensor([1.0, 0.5, 1e-4]))
        self.proj = nn.Linear(3, 3)

    def forward(self, t, x):
        angles = t[:, None].float() * self.freq
        scaled = torch.exp(-math.log(10.0) * torch.arange(3).float() / 3)
        return self.proj(x) + angles * scaled


def test_intervals_follow_casts_products_exp_and_state():
    ranges = _ranges(export(Timestep(), torch.tensor([5, 7]), torch.randn(2, 3)))
    assert ranges["b_freq"] == (torch.tensor(1e-4).item(), 1.0)
    assert ranges["mul"] == (0.0, 999.0)  # declared t range times the buffer's
    low, high = ranges["exp"]
    assert math.isclose(high, 1.0)
    assert math.isclose(low, math.exp(-math.log(10.0) * 2 / 3), rel_tol=1e-6)
    assert ranges["linear"] is None  # an activation: no proven range, and no weight read
    assert ranges["add"] is None


class Positions(nn.Module):
    def forward(self, x):
        return torch.arange(x.shape[1]).float()[:, None] @ torch.ones(1, 4) + x


def test_a_dynamic_length_bounds_arange_and_matrix_products():
    seq = torch.export.Dim("seq", min=2, max=512)
    ep = torch.export.export(Positions(), (torch.randn(1, 8, 4),), dynamic_shapes=({1: seq},))
    ranges = _ranges(ep)
    assert ranges["arange"] == (0, 511)
    assert ranges["matmul"] == (0.0, 511.0)


class Scaled(nn.Module):
    def __init__(self, scale, shift):
        super().__init__()
        self.register_buffer("scale", torch.tensor([scale, -scale / 3]))
        self.shift = shift

    def forward(self, t):
        return torch.exp(-(t[:, None].float() * self.scale - self.shift) / 1000)


@settings(max_examples=examples(18), deadline=None)
@given(
    st.integers(-3000, 3000),
    st.integers(0, 3000),
    st.floats(-4.0, 4.0),
    st.floats(-100.0, 100.0),
    st.integers(0, 2**16),
)
def test_property_every_value_of_a_valid_call_lies_in_its_proven_range(
    low, width, scale, shift, seed
):
    high = low + width
    ep = export(Scaled(scale, shift), torch.tensor([low, high]))
    program = Program(ep)
    ValueRangeAnalysis(program, {"t": (low, high)})(ep.graph_module)
    ranges = FloatRanges(program)
    t = torch.randint(low, high + 1, (64,), generator=torch.Generator().manual_seed(seed))
    values = {}
    with torch.no_grad():

        class Recorder(LeanInterpreter):
            def run_node(self, node):
                values[node] = result = super().run_node(node)
                return result

        Recorder(ep.graph_module).run(*program.graph_inputs((t,), {}))
    for node, value in values.items():
        proven = ranges.of(node)
        if proven is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
            slack = 1e-5 * max(1.0, abs(proven.low), abs(proven.high))
            assert proven.low - slack <= value.min() and value.max() <= proven.high + slack
    assert ranges.of(next(n for n in values if n.name == "exp")) is not None
