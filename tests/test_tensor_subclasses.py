"""fx16.program.tensor_subclasses: a state tensor that is a wrapper subclass is seen through its
inner tensors; its 16-bit version converts the fp32 parts and passes the rest on."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.testing._internal.two_tensor import TwoTensor

from fx16.ops.numerics import tensor_to_fp16
from fx16.program.tensor_subclasses import (
    inner_tensors,
    is_subclass,
    narrowed_state,
    narrowed_val,
    state_overflows,
)


class FixedDtypeTwoTensor(TwoTensor):
    """A subclass whose rebuilt tensor always reports fp32: it cannot hold 16-bit values."""

    @staticmethod
    def __new__(cls, a, b, outer_size=None, outer_stride=None):
        shape = outer_size if outer_size is not None else a.shape
        kwargs = {"dtype": torch.float32, "device": a.device, "requires_grad": False}
        return torch.Tensor._make_wrapper_subclass(cls, shape, **kwargs)

    def __init__(self, a, b, outer_size=None, outer_stride=None):
        self.a, self.b = a, b

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return FixedDtypeTwoTensor(inner_tensors["a"], inner_tensors["b"], outer_size)


def _pair(a, b):
    return TwoTensor(a, b)


def test_plain_tensors_are_their_own_inner_tensor():
    tensor = torch.randn(3)
    assert not is_subclass(tensor)
    assert inner_tensors(tensor) == {"": tensor}
    assert torch.equal(narrowed_state(tensor, torch.float16), tensor_to_fp16(tensor))


def test_a_subclass_is_rebuilt_with_16_bit_parts():
    """TwoTensor(a fp32, b fp32) -> TwoTensor(a fp16, b fp16), values as tensor_to_fp16."""
    a, b = torch.randn(4), torch.tensor([1e-9, -3.0, 0.0, 7.5])
    pair = _pair(a, b)
    assert set(inner_tensors(pair)) == {".a", ".b"}
    rebuilt = narrowed_state(pair, torch.float16)
    assert type(rebuilt) is TwoTensor and rebuilt.dtype == torch.float16
    assert torch.equal(rebuilt.b, tensor_to_fp16(b))  # the tiny value is lifted, not flushed
    assert pair.a.dtype == torch.float32  # the input is not modified


# fp32 values across fp16's range: subnormal flushes, overflow, inf, nan, signed zeros.
_values = st.lists(
    st.one_of(
        st.floats(width=32, allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, 1e-9, -3e-8, 65504.0, 65520.0, -7e4]),
    ),
    min_size=1,
    max_size=12,
)


@given(_values, _values)
def test_parts_convert_as_plain_tensors_do(a_values, b_values):
    """Each part of the rebuilt subclass equals tensor_to_fp16 of that part, bit for bit,
    and the overflow check flags exactly the pairs a part of which overflows."""
    size = min(len(a_values), len(b_values))
    a = torch.tensor(a_values[:size], dtype=torch.float32)
    b = torch.tensor(b_values[:size], dtype=torch.float32)
    pair = _pair(a, b)
    overflows = state_overflows(pair, torch.float16)
    finite = [t[torch.isfinite(t)] for t in (a, b)]
    assert overflows == any(bool((t.abs() > 65504).any()) for t in finite)
    if overflows:
        return
    rebuilt = narrowed_state(pair, torch.float16)
    for part, plain in ((rebuilt.a, a), (rebuilt.b, b)):
        expected = tensor_to_fp16(plain)
        assert torch.equal(part.view(torch.int16), expected.view(torch.int16))


def test_overflow_is_checked_in_every_fp32_part():
    assert state_overflows(_pair(torch.zeros(2), torch.tensor([1.0, 7e4])), torch.float16)
    assert not state_overflows(_pair(torch.zeros(2), torch.tensor([1.0, 7e4])), torch.bfloat16)


def test_a_subclass_that_cannot_follow_the_dtype_is_left_alone():
    fixed = FixedDtypeTwoTensor(torch.randn(2), torch.randn(2))
    assert narrowed_state(fixed, torch.float16) is None


def test_fake_values_are_rebuilt_the_same_way():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fake = mode.from_tensor(_pair(torch.randn(3), torch.randn(3)))
    rebuilt = narrowed_val(fake, torch.float16)
    assert type(rebuilt) is TwoTensor and rebuilt.dtype == torch.float16
    assert rebuilt.a.dtype == torch.float16


def test_torchao_int8_tensor_keeps_its_data_object():
    quantization = pytest.importorskip("torchao.quantization")
    linear = torch.nn.Linear(16, 8)
    quantization.quantize_(linear, quantization.Int8WeightOnlyConfig())
    weight = linear.weight
    rebuilt = narrowed_state(weight, torch.float16)
    assert rebuilt.qdata is weight.qdata
    assert rebuilt.scale.dtype == torch.float16 and rebuilt.dtype == torch.float16
    torch.testing.assert_close(
        rebuilt.dequantize().float(), weight.dequantize(), atol=1e-3, rtol=1e-3
    )
