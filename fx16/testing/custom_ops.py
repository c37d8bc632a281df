"""Custom ops (outside aten/prims) as users and quantization libraries write them, and
small models that call them. Registered once, under the ``fx16_test`` namespace."""

import torch
from torch import Tensor, nn


@torch.library.custom_op("fx16_test::dequantize", mutates_args=())
def dequantize(quantized: Tensor, scale: Tensor, output_dtype: torch.dtype) -> Tensor:
    """``quantized * scale`` in the scale's dtype; ``output_dtype`` names the output type
    but, as in coreai's dequantize, the scale's dtype decides it."""
    return quantized.to(scale.dtype) * scale


@dequantize.register_fake
def _(quantized, scale, output_dtype):
    return torch.empty(quantized.shape, dtype=scale.dtype)


@torch.library.custom_op("fx16_test::dequantize_to", mutates_args=())
def dequantize_to(
    quantized: Tensor, scale: Tensor, output_dtype: torch.dtype = torch.float32
) -> Tensor:
    """``quantized * scale`` returned in ``output_dtype``, float32 unless passed (as
    torchao's dequantize_affine)."""
    return (quantized.to(scale.dtype) * scale).to(output_dtype)


@dequantize_to.register_fake
def _(quantized, scale, output_dtype=torch.float32):
    return torch.empty(quantized.shape, dtype=output_dtype)


@torch.library.custom_op("fx16_test::quantize", mutates_args=())
def quantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Round ``x / scale`` to the integer ``dtype``."""
    info = torch.iinfo(dtype)
    return (x / scale).round().clamp(info.min, info.max).to(dtype)


@quantize.register_fake
def _(x, scale, dtype):
    return torch.empty(x.shape, dtype=dtype)


@torch.library.custom_op("fx16_test::scaled_to", mutates_args=())
def scaled_to(x: Tensor, factor: float, dtype: torch.dtype) -> Tensor:
    """``x * factor`` returned in ``dtype``: a user's op whose dtype argument is its output type."""
    return (x * factor).to(dtype)


@scaled_to.register_fake
def _(x, factor, dtype):
    return torch.empty_like(x, dtype=dtype)


@torch.library.custom_op("fx16_test::always_fp32", mutates_args=())
def always_fp32(x: Tensor) -> Tensor:
    """``2 * x`` computed and returned in fp32, whatever the input's dtype."""
    return x.float() * 2


@always_fp32.register_fake
def _(x):
    return torch.empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("fx16_test::fp32_only", mutates_args=())
def fp32_only(x: Tensor) -> Tensor:
    """``x + 1``, defined for fp32 inputs only: its fake kernel refuses anything else."""
    if x.dtype != torch.float32:
        raise TypeError(f"fp32_only takes float32, got {x.dtype}")
    return x + 1


@fp32_only.register_fake
def _(x):
    if x.dtype != torch.float32:
        raise TypeError(f"fp32_only takes float32, got {x.dtype}")
    return torch.empty_like(x)


class QuantizedLinear(nn.Module):
    """An int8 weight dequantized by a custom op (``output_dtype=torch.float32``), an
    activation quantized and dequantized around it, then a Linear in float."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(width, width, generator=generator)
        scale = weight.abs().amax(1, keepdim=True) / 127
        self.register_buffer("qweight", torch.round(weight / scale).to(torch.int8))
        self.register_buffer("weight_scale", scale)
        self.register_buffer("input_scale", torch.tensor(0.05))
        self.bias = nn.Parameter(torch.randn(width, generator=generator))

    def forward(self, x):
        weight = torch.ops.fx16_test.dequantize(self.qweight, self.weight_scale, torch.float32)
        q = torch.ops.fx16_test.quantize(x, self.input_scale, torch.int8)
        x = torch.ops.fx16_test.dequantize(q, self.input_scale, torch.float32)
        return nn.functional.linear(x, weight, self.bias).relu()


class DefaultDtypeDequantize(nn.Module):
    """An int8 weight dequantized by an op that returns its default dtype, float32."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.register_buffer("qweight", torch.randint(-127, 128, (width, width), dtype=torch.int8))
        self.register_buffer("scale", torch.full((width, 1), 0.01))

    def forward(self, x):
        return x @ torch.ops.fx16_test.dequantize_to(self.qweight, self.scale).t()


class UserOps(nn.Module):
    """A user's custom ops between ordinary ones: one with a dtype argument, one that
    always returns fp32, one that takes fp32 only."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        x = torch.ops.fx16_test.scaled_to(self.linear(x), 0.5, torch.float32)
        x = torch.ops.fx16_test.always_fp32(x.tanh())
        x = torch.ops.fx16_test.fp32_only(x.sigmoid())
        return self.linear(x)
