"""ConditioningAnalysis: ops that amplify 16-bit input rounding stay fp32, with what they read.

The traps: rotary angles from cache positions, diffusion timesteps, sinusoidal
position tables from a dynamic sequence length, exp of large logits, log near 1, and
cancelling subtractions. Each is checked on its decision alone, then against fp64.
"""

import copy
import math

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from benchmarks.precision_zoo import RotaryAttention, SinusoidalPositions, TimestepEmbedding
from fx16.analysis import CalibrationAnalysis, ConditioningAnalysis, ValueRangeAnalysis
from fx16.decisions import PRECISION, Reason
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.program.stats import relative_error
from helpers import check_program, export, fp64_reference, run

KEY = ConditioningAnalysis.META_KEY


def _analyse(ep, policy=None, calibration=None):
    program = Program(ep)
    CalibrationAnalysis(program, calibration)(ep.graph_module)
    ValueRangeAnalysis(program)(ep.graph_module)
    result = ConditioningAnalysis(program, policy)(ep.graph_module)
    assert not result.modified
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
