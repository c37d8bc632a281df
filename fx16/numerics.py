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

    One read of the source and one write of the result, at memory speed: a contiguous
    tensor is converted in cache-sized chunks, each checked while it is still in cache
    for elements that flushed to zero, which are then lifted by index. The result
    keeps the source's strides; -0.0, inf and nan pass through.
    """
    source = tensor.detach()
    converted = torch.empty_like(source, dtype=dtype)
    if source.is_contiguous() and source.numel() > _CHUNK:
        flat_source, flat_converted = source.view(-1), converted.view(-1)
        for start in range(0, source.numel(), _CHUNK):
            end = start + _CHUNK
            _convert_chunk(flat_source[start:end], flat_converted[start:end])
    else:
        _convert_chunk(source, converted)
    return converted


# Elements per chunk: 1 MiB of fp32 and its 16-bit copy stay in a core's L2 cache. The
# ops on a chunk are parallel inside torch, so chunks use every core too.
_CHUNK = 1 << 18
_MAGNITUDE_BITS = 0x7FFF  # a 16-bit float without its sign bit: 0 exactly for +-0.0


def _convert_chunk(source: torch.Tensor, converted: torch.Tensor) -> None:
    """``converted[:] = source`` in 16 bits, with flushed nonzero elements lifted to
    +-the smallest subnormal (as rounding would give them if it did not flush)."""
    converted.copy_(source)
    if source.dim() == 0:  # after the copy: torch rounds a 0-d nan to other bits than a 1-d one
        source, converted = source.view(1), converted.view(1)
    magnitudes = converted.view(torch.int16) & _MAGNITUDE_BITS
    if magnitudes.numel() == 0 or int(magnitudes.min()) != 0:
        return  # no +-0.0 at all: nothing flushed (min over ints is cheap, a float == is not)
    zeros = magnitudes.eq(0).nonzero(as_tuple=True)
    values = source[zeros]
    flushed = values.ne(0)
    if bool(flushed.any()):
        positions = tuple(index[flushed] for index in zeros)
        tiny = torch.full_like(values[flushed], smallest_subnormal(converted.dtype))
        converted[positions] = torch.copysign(tiny, values[flushed]).to(converted.dtype)
