"""Number facts and conversions for 16-bit floats (fp16 and bf16).

fp16 holds finite magnitudes up to 65504 and nonzero magnitudes down to 2**-24
(the smallest subnormal, about 5.96e-8); bf16 has fp32's range (up to about 3.39e38,
down to 2**-133) with fewer significand bits. Everything here is about values, not
graphs: whether a scalar or a tensor fits, and how to convert one so that nothing
overflows and nothing small flushes to zero.
"""

import functools
import math

import torch

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # smallest positive fp16 subnormal, ~5.96e-8

# A finite scalar at least this large stands for "minus/plus infinity" (finfo(float32).min,
# -1e38 attention masks...). It saturates to the 16-bit maximum instead of keeping the op
# in fp32.
INF_LIKE = 1e38


@functools.cache
def largest(dtype: torch.dtype = torch.float16) -> float:
    return float(torch.finfo(dtype).max)


@functools.cache
def smallest_subnormal(dtype: torch.dtype = torch.float16) -> float:
    info = torch.finfo(dtype)
    return float(info.tiny * info.eps)


def round_scalar_to_fp16(value: float, dtype: torch.dtype = torch.float16) -> float | None:
    """The value of ``dtype`` (fp16 by default) to use in place of ``value``, or None.

    - magnitudes above the dtype's maximum but below INF_LIKE cannot be represented: None;
    - larger finite magnitudes (>= INF_LIKE) are infinity-like sentinels: +-maximum;
    - nonzero magnitudes below the smallest subnormal: +-smallest subnormal (no flush);
    - inf and nan are kept; everything else is rounded to the nearest value of ``dtype``.
    """
    if math.isnan(value) or math.isinf(value) or value == 0.0:
        return value
    magnitude, top, tiny = abs(value), largest(dtype), smallest_subnormal(dtype)
    if magnitude > top:
        return math.copysign(top, value) if magnitude >= INF_LIKE else None
    if magnitude < tiny:
        return math.copysign(tiny, value)
    return _nearest(float(value), dtype)


@functools.lru_cache(maxsize=65536)
def _nearest(value: float, dtype: torch.dtype) -> float:
    """The nearest ``dtype`` value to a finite nonzero ``value`` (models repeat their
    scalars: each is rounded once, not once per op)."""
    return float(torch.tensor(value, dtype=dtype))


def tensor_overflows_fp16(tensor: torch.Tensor, dtype: torch.dtype = torch.float16) -> bool:
    """True when any finite element exceeds ``dtype``'s maximum (inf and nan do not count)."""
    if tensor.numel() == 0:
        return False
    low, high = tensor.detach().aminmax()
    top = largest(dtype)
    if -top <= float(low) and float(high) <= top:  # the common case, one pass, no copy
        return False
    magnitude = tensor.detach().abs()
    finite = torch.isfinite(magnitude)
    return bool((magnitude[finite] > top).any())


def tensor_to_fp16(tensor: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Convert an fp32 tensor that fits to ``dtype``, lifting tiny nonzero magnitudes to
    its smallest subnormal. The input is not modified. Call ``tensor_overflows_fp16``
    first: values above the maximum would become inf here.
    """
    source = tensor.detach()
    converted = source.to(dtype)
    # Magnitudes below the smallest subnormal either round up to it (as lifting would)
    # or flush to zero; only a flush changes the count of nonzeros.
    if int(torch.count_nonzero(converted)) == int(torch.count_nonzero(source)):
        return converted
    tiny_value = smallest_subnormal(dtype)
    tiny = (source != 0) & (source.abs() < tiny_value)
    lifted = torch.copysign(torch.full_like(source, tiny_value), source)
    return torch.where(tiny, lifted, source).to(dtype)
