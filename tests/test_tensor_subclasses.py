"""fx16.tensor_subclasses: a state tensor that is a wrapper subclass is seen through its
inner tensors; its 16-bit version converts the fp32 parts and passes the rest on."""

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from fx16.numerics import tensor_to_fp16
from fx16.tensor_subclasses import (
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
