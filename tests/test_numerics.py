"""fx16.numerics: which scalars and tensors fit fp16, and how they convert."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fx16.numerics import (
    FP16_MAX,
    FP16_TINY,
    round_scalar_to_fp16,
    tensor_overflows_fp16,
    tensor_to_fp16,
)


def test_constants_match_numpy():
    assert FP16_MAX == float(np.finfo(np.float16).max)
    assert FP16_TINY == float(np.nextafter(np.float16(0), np.float16(1)))


@pytest.mark.parametrize(
    "value, expected",
    [
        (1.0, 1.0),
        (0.1, float(np.float16(0.1))),
        (65504.0, 65504.0),
        (-65504.0, -65504.0),
        (70000.0, None),
        (-1e9, None),
        (1e38, FP16_MAX),
        (-3.4028234663852886e38, -FP16_MAX),
        (float("inf"), float("inf")),
        (1e-9, FP16_TINY),
        (-1e-12, -FP16_TINY),
        (0.0, 0.0),
    ],
)
def test_round_scalar_to_fp16(value, expected):
    assert round_scalar_to_fp16(value) == expected


def test_nan_stays_nan():
    assert math.isnan(round_scalar_to_fp16(float("nan")))


@given(st.floats(allow_nan=False, width=64))
def test_rounded_scalars_are_fp16_values_of_the_same_sign(value):
    rounded = round_scalar_to_fp16(value)
    if rounded is None:
        assert FP16_MAX < abs(value) < 1e38
        return
    assert float(np.float16(rounded)) == rounded
    assert (
        rounded == 0.0 if value == 0.0 else math.copysign(1.0, rounded) == math.copysign(1.0, value)
    )


def test_tensor_overflow_ignores_inf_and_nan():
    assert not tensor_overflows_fp16(torch.tensor([1.0, float("inf"), float("nan"), -65504.0]))
    assert tensor_overflows_fp16(torch.tensor([1.0, -65505.0]))
    assert not tensor_overflows_fp16(torch.empty(0))


@given(
    st.lists(st.floats(min_value=-FP16_MAX, max_value=FP16_MAX, width=32), min_size=1, max_size=20)
)
def test_tensor_to_fp16_never_flushes_nonzero_values(values):
    source = torch.tensor(values, dtype=torch.float32)
    converted = tensor_to_fp16(source)
    assert converted.dtype == torch.float16
    assert torch.equal(converted == 0, source == 0)
    assert torch.isfinite(converted).all()
    assert torch.equal(torch.sign(converted.float()), torch.sign(source))
    # away from the subnormal floor, conversion is plain rounding
    normal = source.abs() >= FP16_TINY
    assert torch.equal(converted[normal], source[normal].half())
