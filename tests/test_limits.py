"""Each limit fx16 decides by, pinned at its exact boundary: int16's ends, fp16's maximum
with the overflow margin, the subnormal and normal thresholds. The expected values are
written out (IEEE 754 binary16, two's complement int16), not read from fx16's code."""

import pytest
import torch

import fx16
from fx16.analysis.intervals import Source, ValueRange
from fx16.ops.numerics import (
    interval_may_flush,
    interval_overflows,
    largest,
    round_scalar_to_fp16,
    scalar_overflows,
    smallest_normal,
    smallest_subnormal,
)
from fx16.policy import PrecisionPolicy
from helpers import export

FP16_MAX = 65504.0
FP16_SMALLEST_NORMAL = 2.0**-14  # 6.103515625e-05
FP16_SMALLEST_SUBNORMAL = 2.0**-24  # 5.960464477539063e-08


@pytest.mark.parametrize(
    "low, high, fits",
    [
        (-32768, 32767, True),
        (0, 32767, True),
        (0, 32768, False),
        (-32769, 0, False),
        (-32768, -32768, True),
    ],
)
def test_int16_fits_exactly_its_twos_complement_range(low, high, fits):
    assert ValueRange(low, high, Source.PROVEN).fits(torch.int16) is fits


class SumTimesB(torch.nn.Module):
    """(a + b) * b: the add fits int16 only while a + b <= 32767."""

    def forward(self, a, b):
        return (a + b) * b


@pytest.mark.parametrize("top, add_narrowed", [(16383, True), (16384, False)])
def test_int16_narrowing_stops_at_32768(top, add_narrowed):
    """a, b in [0, top]: a + b reaches 32766 (narrowed) or 32768 (kept int64); the
    result is exact either way: 16384 * 32768 = 536870912."""
    a, b = torch.tensor([top, 1]), torch.tensor([top, 2])
    ep = export(SumTimesB(), a, b)
    fx16.cast_to_16_bit_precision(ep, input_ranges={"a": (0, top), "b": (0, top)})
    (add,) = [n for n in ep.graph.nodes if n.target == torch.ops.aten.add.Tensor]
    assert (add.meta["val"].dtype == torch.int16) is add_narrowed
    args, kwargs = fx16.inputs_for(ep, a, b)
    assert ep.module()(*args, **kwargs).tolist() == [2 * top * top, 6]


class TimesFour(torch.nn.Module):
    """h = 4x: its calibrated magnitude decides, with the margin of 2 (65504 / 2 = 32752)."""

    def forward(self, x):
        return (x * 4.0).relu() * 0.25


@pytest.mark.parametrize("value, narrowed", [(8188.0, True), (8192.0, False)])
def test_the_overflow_margin_keeps_values_above_half_the_fp16_maximum(value, narrowed):
    """4 * 8188 = 32752 = 65504 / 2 fits with the default margin; 4 * 8192 = 32768 does
    not, and the product runs in fp32 (a limit of 65504 would narrow both). Without scale
    domains, which would carry it in fp16 at 2**-1."""
    ep = export(TimesFour(), torch.tensor([[value, 1.0]]))
    fx16.cast_fp32_to_fp16(ep, policy=PrecisionPolicy(scale_range=False))
    (product,) = [n for n in ep.graph.nodes if n.target == torch.ops.aten.mul.Tensor][:1]
    expected = torch.float16 if narrowed else torch.float32
    assert product.meta["val"].dtype == expected


def test_fp16_thresholds_are_ieee_binary16():
    assert largest(torch.float16) == FP16_MAX
    assert smallest_normal(torch.float16) == FP16_SMALLEST_NORMAL
    assert smallest_subnormal(torch.float16) == FP16_SMALLEST_SUBNORMAL


@pytest.mark.parametrize(
    "value, overflows",
    [(FP16_MAX, False), (65504.5, True), (-65505.0, True), (1e38, False), (float("inf"), False)],
)
def test_a_scalar_overflows_just_above_the_fp16_maximum(value, overflows):
    """1e38 and inf are infinity-like sentinels (saturated), not overflows."""
    assert scalar_overflows(value, torch.float16) is overflows


def test_a_tiny_scalar_is_lifted_to_the_smallest_subnormal_not_flushed():
    assert round_scalar_to_fp16(FP16_SMALLEST_SUBNORMAL) == FP16_SMALLEST_SUBNORMAL
    assert round_scalar_to_fp16(FP16_SMALLEST_SUBNORMAL / 4) == FP16_SMALLEST_SUBNORMAL
    assert round_scalar_to_fp16(-1e-30) == -FP16_SMALLEST_SUBNORMAL


@pytest.mark.parametrize(
    "interval, overflows",
    [((0.0, FP16_MAX), False), ((0.0, 65520.0), True), ((-65520.0, 0.0), True)],
)
def test_an_interval_overflows_past_the_fp16_maximum(interval, overflows):
    assert interval_overflows(interval, torch.float16) is overflows


@pytest.mark.parametrize(
    "interval, may_flush",
    [
        ((FP16_SMALLEST_SUBNORMAL, 1.0), False),
        ((FP16_SMALLEST_SUBNORMAL / 2, 1.0), True),
        ((-1.0, -FP16_SMALLEST_SUBNORMAL), False),
        ((-1.0, 1.0), True),  # spans zero: values near it may flush
        ((0.0, 0.0), False),
    ],
)
def test_flushing_starts_below_the_smallest_subnormal(interval, may_flush):
    assert interval_may_flush(interval, torch.float16) is may_flush
