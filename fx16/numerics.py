"""Number facts and conversions for 16-bit floats.

fp16 holds finite magnitudes up to 65504 and nonzero magnitudes down to 2**-24
(the smallest subnormal, about 5.96e-8). Everything here is about values, not
graphs: whether a scalar or a tensor fits, and how to convert one so that
nothing overflows and nothing small flushes to zero.
"""

import math

import torch

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # smallest positive fp16 subnormal, ~5.96e-8

# A finite scalar at least this large stands for "minus/plus infinity" (finfo(float32).min,
# -1e38 attention masks...). It saturates to +-FP16_MAX instead of keeping the op in fp32.
INF_LIKE = 1e38


def round_scalar_to_fp16(value: float) -> float | None:
    """The fp16 value to use in place of ``value``, or None when it does not fit.

    - magnitudes in (FP16_MAX, INF_LIKE) cannot be represented: None;
    - finite magnitudes >= INF_LIKE are infinity-like sentinels: +-FP16_MAX;
    - nonzero magnitudes below FP16_TINY: +-FP16_TINY (no flush to zero);
    - inf and nan are kept; everything else is rounded to the nearest fp16.
    """
    if math.isnan(value) or math.isinf(value) or value == 0.0:
        return value
    magnitude = abs(value)
    if magnitude >= INF_LIKE:
        return math.copysign(FP16_MAX, value)
    if magnitude > FP16_MAX:
        return None
    if magnitude < FP16_TINY:
        return math.copysign(FP16_TINY, value)
    return float(torch.tensor(value, dtype=torch.float16))


def scalar_overflows_fp16(value: float) -> bool:
    """True for a finite magnitude that fp16 cannot hold and that is not an inf-like sentinel."""
    return round_scalar_to_fp16(value) is None


def tensor_overflows_fp16(tensor: torch.Tensor) -> bool:
    """True when any finite element has a magnitude above FP16_MAX (inf and nan do not count)."""
    if tensor.numel() == 0:
        return False
    magnitude = tensor.detach().abs()
    finite = torch.isfinite(magnitude)
    return bool((magnitude[finite] > FP16_MAX).any())


def tensor_to_fp16(tensor: torch.Tensor) -> torch.Tensor:
    """Convert an fp32 tensor that fits to fp16, lifting tiny nonzero magnitudes to FP16_TINY.

    The input is not modified. Call ``tensor_overflows_fp16`` first: values above
    FP16_MAX would become inf here.
    """
    source = tensor.detach()
    tiny = (source != 0) & (source.abs() < FP16_TINY)
    if bool(tiny.any()):
        source = torch.where(
            tiny, torch.copysign(torch.full_like(source, FP16_TINY), source), source
        )
    return source.to(torch.float16)
