"""fx16.ops.numerics: which scalars and tensors fit fp16, and how they convert."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fx16.ops.numerics import (
    FP16_MAX,
    FP16_TINY,
    conversion_scratch,
    convert_in_place,
    finite_interval,
    interval_may_flush,
    round_scalar_to_fp16,
    scalar_overflows,
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


def _reference_to_16_bit(source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The conversion as fx16 0.1 did it, one full-size op at a time: round to ``dtype``;
    if that flushed anything, every nonzero element whose magnitude is below the
    smallest subnormal becomes +-that subnormal."""
    converted = source.to(dtype)
    if int(torch.count_nonzero(converted)) == int(torch.count_nonzero(source)):
        return converted
    tiny_value = float(torch.finfo(dtype).tiny * torch.finfo(dtype).eps)
    tiny = (source != 0) & (source.abs() < tiny_value)
    lifted = torch.copysign(torch.full_like(source, tiny_value), source)
    return torch.where(tiny, lifted, source).to(dtype)


_SPECIAL_VALUES = [
    0.0,
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    7e4,  # overflows fp16 (inf after conversion)
    -65520.0,  # the first magnitude that rounds to inf
    65519.0,  # rounds down to 65504
    2.0**-25,  # halfway to the smallest fp16 subnormal: rounds to zero, must be lifted
    -(2.0**-25),
    3e-8,
    -1e-8,
    1e-45,  # an fp32 subnormal: flushes in fp16 and in bf16
    -1e-45,
    2.0**-24,
    1.0,
]


# Up to 64 values, the special ones and the tiny ones often: the conversions' edge cases.
_EDGE_VALUES = st.lists(
    st.one_of(
        st.sampled_from(_SPECIAL_VALUES),
        st.floats(width=32, allow_nan=True, allow_infinity=True),
        st.floats(min_value=-(2.0**-20), max_value=2.0**-20, width=32),
    ),
    min_size=1,
    max_size=64,
)


@given(
    values=_EDGE_VALUES,
    repeats=st.sampled_from([1, 3, 9000]),  # 9000 x up to 64 spans several chunks
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    layout=st.sampled_from(["flat", "transposed", "scalar"]),
)
def test_tensor_to_fp16_is_bit_identical_to_the_definition(values, repeats, dtype, layout):
    """Overflowing, subnormal, inf, nan and -0.0 elements, in chunks or not, contiguous
    or transposed: every bit of the result, and its strides, as the full-size ops give."""
    source = torch.tensor(values * repeats, dtype=torch.float32)
    if layout == "transposed" and source.numel() % 2 == 0:
        source = source.view(2, -1).t()
    elif layout == "scalar":
        source = source[0]
    expected = _reference_to_16_bit(source, dtype)
    converted = tensor_to_fp16(source, dtype)
    assert converted.dtype == dtype
    sized = [d for d in range(source.dim()) if source.shape[d] > 1]  # size 1: any stride
    assert [converted.stride(d) for d in sized] == [source.stride(d) for d in sized]
    assert torch.equal(converted.view(torch.int16), expected.view(torch.int16))


@given(
    values=_EDGE_VALUES,
    repeats=st.sampled_from([1, 3, 20000]),  # 20000 x up to 64 spans two chunks
    to_fp16=st.booleans(),
    may_flush=st.booleans(),
)
def test_converting_in_place_gives_the_copys_bits_in_the_same_memory(
    values, repeats, to_fp16, may_flush
):
    """A bf16 tensor made fp16 over its own memory (or fp16 made bf16): the storage is the
    same, and every bit is what ``tensor_to_fp16`` gives as a copy (flushed elements
    lifted where they may flush: in every chunk)."""
    source, dtype = (torch.bfloat16, torch.float16) if to_fp16 else (torch.float16, torch.bfloat16)
    original = torch.tensor(values * repeats, dtype=torch.float32).to(source)
    if not may_flush:  # the caller knows none flushes: the values that do are left out
        tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
        original = torch.where(original.float().abs() < tiny, 0.0, original.float()).to(source)
    expected = tensor_to_fp16(original, dtype, may_flush=may_flush)
    memory = original.clone()
    converted = convert_in_place(memory, dtype, may_flush=may_flush)
    assert converted.dtype == dtype and converted.data_ptr() == memory.data_ptr()
    assert torch.equal(converted.view(torch.int16), expected.view(torch.int16))


_ANY_VALUES = st.lists(
    st.one_of(
        st.floats(width=32, allow_nan=True, allow_infinity=True),
        st.floats(min_value=-(2.0**-20), max_value=2.0**-20, width=32),
        st.sampled_from([0.0, -0.0, 1.0, FP16_TINY, -FP16_TINY, 2.0**-25]),
    ),
    min_size=1,
    max_size=64,
)


@st.composite
def _one_sided_values(draw):
    """Values all on one side of zero, at least fp16's smallest subnormal (2^-24) from it,
    with infinities and NaNs among them: an interval that rules out flushes, or all zeros."""
    if draw(st.booleans()) and draw(st.booleans()):
        return [0.0] * draw(st.integers(1, 8))
    sign = draw(st.sampled_from([1.0, -1.0]))
    magnitudes = st.floats(min_value=2.0**-24, max_value=2.0**127, width=32)
    extra = st.sampled_from([math.inf, -math.inf, math.nan])
    values = draw(st.lists(st.one_of(magnitudes, magnitudes, extra), min_size=1, max_size=64))
    return [v if v != v or math.isinf(v) else sign * v for v in values]


def test_an_interval_that_rules_out_flushes_is_right_and_a_plain_copy_is_exact():
    """Where a tensor's finite interval says no nonzero element can flush, none does,
    and the plain conversion ``may_flush=False`` asks for is bit-identical to the checked
    one. Most drawn tensors are one-sided (the case the assertion is about): counted."""
    reached = []

    @given(
        values=st.one_of(_one_sided_values(), _one_sided_values(), _ANY_VALUES),
        dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    )
    def check(values, dtype):
        source = torch.tensor(values, dtype=torch.float32)
        if interval_may_flush(finite_interval(source), dtype):
            reached.append(False)
            return
        reached.append(True)
        assert int(((source.to(dtype) == 0) & (source != 0)).sum()) == 0
        expected = _reference_to_16_bit(source, dtype)
        converted = tensor_to_fp16(source, dtype, may_flush=False)
        assert torch.equal(converted.view(torch.int16), expected.view(torch.int16))

    check()
    assert sum(reached) >= len(reached) / 2, f"reached in {sum(reached)} of {len(reached)}"


def test_finite_interval_and_which_intervals_may_flush():
    assert finite_interval(torch.tensor([2.0, -math.inf, math.nan, -3.0])) == (-3.0, 2.0)
    assert finite_interval(torch.tensor([math.inf, math.nan])) is None
    assert finite_interval(torch.empty(0)) is None
    assert not interval_may_flush((0.0, 0.0), torch.float16)  # a zero bias
    assert not interval_may_flush((1.0, 1.0), torch.float16)  # a LayerNorm weight
    assert not interval_may_flush((-5.0, -FP16_TINY), torch.float16)  # one side of zero
    assert not interval_may_flush(None, torch.float16)  # nothing finite
    assert interval_may_flush((-0.1, 0.1), torch.float16)  # may hold a 1e-9
    assert interval_may_flush((0.0, 1.0), torch.float16)
    assert interval_may_flush((1e-9, 1.0), torch.float16)
    assert not interval_may_flush((1e-9, 1.0), torch.bfloat16)  # bf16 holds 1e-9


def test_tensor_to_fp16_lifts_flushed_values_in_every_chunk():
    """A tensor of several chunks (of 2**20 elements) with flushing values at chunk edges."""
    source = torch.full((2 * 2**20 + 5,), 0.5)
    edges = [0, 2**20 - 1, 2**20, 2 * 2**20 + 2, source.numel() - 1]
    source[edges] = torch.tensor([1e-9, -1e-9, 2.0**-25, -(2.0**-25), 1e-45])
    converted = tensor_to_fp16(source)
    assert converted[edges].tolist() == [FP16_TINY, -FP16_TINY, FP16_TINY, -FP16_TINY, FP16_TINY]
    assert torch.equal(
        converted.view(torch.int16), _reference_to_16_bit(source, torch.float16).view(torch.int16)
    )


@pytest.mark.parametrize("pruned", [0.0, 0.5])
def test_tensor_to_fp16_of_random_weights_with_flushes_in_many_blocks(pruned):
    """Weights drawn from N(0, 0.002) hold elements that flush in many 4096-element
    blocks; half of them pruned to zero puts a zero in every block; a tail under a block."""
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(3 * 2**20 + 123, generator=generator) * 0.002  # 10x the flushes
    source[torch.rand(source.shape, generator=generator) < pruned] = 0.0
    expected = _reference_to_16_bit(source, torch.float16)
    assert int(((source.half() == 0) & (source != 0)).sum()) > 10  # in many blocks
    assert torch.equal(tensor_to_fp16(source).view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("elements", [1000, 2 * 2**20 + 5])
def test_a_scratch_on_another_device_is_not_used(elements):
    """A program's weights on a GPU get a scratch there: one on another device (a
    ``meta`` one stands in for it here) is left alone, and the values are the same."""
    source = torch.full((elements,), 0.5)
    source[[0, elements - 1]] = torch.tensor([1e-9, -1e-9])
    elsewhere = conversion_scratch(elements, device="meta")
    assert elsewhere.device.type == "meta" and elsewhere.dtype == torch.int16
    converted = tensor_to_fp16(source, torch.float16, elsewhere)
    assert converted.device == source.device
    assert torch.equal(
        converted.view(torch.int16), _reference_to_16_bit(source, torch.float16).view(torch.int16)
    )


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5, 2)])
def test_tensor_to_fp16_of_an_empty_tensor(shape):
    """An empty weight (a compressed program's unused scale) converts to an empty 16-bit one."""
    converted = tensor_to_fp16(torch.empty(shape))
    assert converted.dtype == torch.float16 and converted.shape == shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", [math.nan, -0.0, 1e-9, -1e-45, 7e4])
def test_tensor_to_fp16_of_a_0d_tensor_is_bit_identical(value, dtype):
    source = torch.tensor(value)
    expected = _reference_to_16_bit(source, dtype)
    assert torch.equal(tensor_to_fp16(source, dtype).view(torch.int16), expected.view(torch.int16))


@given(
    value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**40), 10**40)),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_scalar_overflows_exactly_where_rounding_has_no_answer(value, dtype):
    assert scalar_overflows(value, dtype) == (round_scalar_to_fp16(float(value), dtype) is None)


@pytest.mark.parametrize(
    "source",
    [
        torch.tensor([1e-30]),  # one element, flushed
        torch.tensor([1e-30, 1.0, -2e-30, 3.0])[::2],  # a strided 1-d view
        torch.tensor(-1e-30),  # 0-d
    ],
    ids=["single", "strided", "scalar"],
)
def test_a_flushed_element_is_lifted_in_every_layout(source):
    """Each nonzero below 2^-24 becomes +-2^-24 with its sign, whatever the layout."""
    converted = tensor_to_fp16(source)
    expected = torch.copysign(torch.full_like(source, 2.0**-24), source).half()
    assert converted.shape == source.shape
    assert torch.equal(converted, expected)


def test_the_largest_sentinel_is_not_an_overflow():
    """fp32's nearest value to 1e38 (INF_LIKE) is a sentinel: saturated, not kept fp32."""
    sentinel = float(torch.tensor(1e38, dtype=torch.float32))
    assert not scalar_overflows(sentinel, torch.float16)
    assert scalar_overflows(float(torch.tensor(9.9e37, dtype=torch.float32)), torch.float16)


def test_the_largest_sentinel_saturates():
    sentinel = float(torch.tensor(1e38, dtype=torch.float32))
    assert round_scalar_to_fp16(sentinel) == FP16_MAX
    assert round_scalar_to_fp16(-sentinel) == -FP16_MAX
