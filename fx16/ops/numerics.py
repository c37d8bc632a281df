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
# -1e38 attention masks, the -1e38 a running maximum starts from). It saturates to the
# 16-bit maximum instead of keeping the op in fp32. 1e38 as fp32 holds it (9.99999968e37):
# a -1e38 the model computes in fp32 is a sentinel too.
INF_LIKE = float(torch.tensor(1e38, dtype=torch.float32))


@functools.cache
def largest(dtype: torch.dtype = torch.float16) -> float:
    return float(torch.finfo(dtype).max)


@functools.cache
def smallest_normal(dtype: torch.dtype = torch.float16) -> float:
    """Below this a value loses significant bits (fp16: 6.1e-5)."""
    return float(torch.finfo(dtype).tiny)


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


def scalar_for_16_bit_op(
    value: float, dtype: torch.dtype = torch.float16, guard: bool = False
) -> float | None:
    """The number an op computing in ``dtype`` takes in place of the Python float
    ``value``: ``value`` itself, since eager PyTorch applies a scalar in the op's fp32
    math (``z / 0.18215`` divides by fp32's 0.18215, not fp16's 0.18212890625); except
    an infinity-like sentinel, saturated to +-maximum (a 16-bit kernel refuses it), a
    nonzero magnitude below the smallest subnormal that keeps the op's result above zero
    (``guard``: ``var + 1e-12``, whose sum with a zero would round to a flush, a clamp's
    positive minimum; ``fx16.plan.values.guards``), clamped to it, and
    None where it overflows (the op stays fp32). A tiny scalar the op multiplies by
    stays as it is: clamped, ``x * 1e-9`` would come out 60 times too large."""
    rounded = round_scalar_to_fp16(value, dtype)
    if rounded is None or abs(value) >= INF_LIKE:
        return rounded
    if 0 < abs(value) < smallest_subnormal(dtype):
        return rounded if guard else value
    return value


def flushes_to_zero(value: float, dtype: torch.dtype = torch.float16) -> bool:
    """A nonzero ``value`` that rounds to zero in ``dtype``: at most half the smallest
    subnormal (the halfway case rounds to the even zero)."""
    return 0 < abs(value) <= smallest_subnormal(dtype) / 2


def scalar_overflows(value: float, dtype: torch.dtype = torch.float16) -> bool:
    """``round_scalar_to_fp16(value, dtype)`` is None: a finite magnitude beyond the
    dtype's maximum that is not an infinity-like sentinel."""
    magnitude = abs(value)
    return largest(dtype) < magnitude < INF_LIKE


@functools.lru_cache(maxsize=65536)
def _nearest(value: float, dtype: torch.dtype) -> float:
    """The nearest ``dtype`` value to a finite nonzero ``value`` (models repeat their
    scalars: each is rounded once, not once per op)."""
    return float(torch.tensor(value, dtype=dtype))


def tensor_overflows_fp16(tensor: torch.Tensor, dtype: torch.dtype = torch.float16) -> bool:
    """True when any finite element exceeds ``dtype``'s maximum (inf and nan do not count)."""
    return interval_overflows(finite_interval(tensor), dtype)


def finite_interval(tensor: torch.Tensor) -> tuple[float, float] | None:
    """The smallest and largest finite element (None: the tensor holds none). One
    reduction where every element is finite, the common case."""
    source = tensor.detach()
    if source.numel() == 0:
        return None
    low, high = (float(bound) for bound in source.aminmax())
    if math.isfinite(low) and math.isfinite(high):
        return low, high
    finite = source[torch.isfinite(source)]
    return None if finite.numel() == 0 else tuple(float(b) for b in finite.aminmax())


def interval_overflows(interval: tuple[float, float] | None, dtype: torch.dtype) -> bool:
    """A value in ``interval`` (finite elements' bounds; None: none) exceeds ``dtype``'s maximum."""
    return interval is not None and max(-interval[0], interval[1]) > largest(dtype)


def interval_below_normal(interval: tuple[float, float] | None, dtype: torch.dtype) -> bool:
    """Every value in ``interval`` lies below ``dtype``'s smallest normal, and one is
    nonzero: in ``dtype`` the whole tensor is subnormal or zero, its precision gone."""
    if interval is None:
        return False
    largest_magnitude = max(-interval[0], interval[1])
    return 0.0 < largest_magnitude < torch.finfo(dtype).tiny


def interval_may_flush(interval: tuple[float, float] | None, dtype: torch.dtype) -> bool:
    """A nonzero value in ``interval`` may lie below ``dtype``'s smallest subnormal (and
    flush to zero in a plain conversion). False for a tensor of zeros, or one whose
    elements all lie on one side of zero, at least that far from it."""
    if interval is None:
        return False
    low, high = interval
    tiny = smallest_subnormal(dtype)
    return not (low == high == 0.0 or low >= tiny or high <= -tiny)


def tensor_to_fp16(
    tensor: torch.Tensor,
    dtype: torch.dtype = torch.float16,
    scratch: torch.Tensor | None = None,
    may_flush: bool = True,
) -> torch.Tensor:
    """Convert an fp32 tensor that fits to ``dtype``, lifting tiny nonzero magnitudes to
    its smallest subnormal. The input is not modified. Call ``tensor_overflows_fp16``
    first: values above the maximum would become inf here.

    One read of the source and one write of the result, at memory speed: a contiguous
    tensor is converted in cache-sized chunks, each checked while it is still in cache
    for elements that flushed to zero, which are then lifted by index. The result
    keeps the source's strides; -0.0, inf and nan pass through. ``scratch``: a buffer
    from ``conversion_scratch()`` to reuse (one per run of conversions: each temporary
    left between the retained 16-bit tensors is a hole in the heap). ``may_flush=False``:
    the caller knows no nonzero element lies below ``dtype``'s smallest subnormal (its
    ``finite_interval``, by ``interval_may_flush``), so a plain copy is exact.
    """
    source = tensor.detach()
    if source.numel() == 0:
        return source.to(dtype)
    if not may_flush and source.dim() and source.is_contiguous():
        return source.to(dtype)
    if source.dim() and source.is_contiguous() and source.numel() <= _CHUNK:  # one chunk
        converted = source.to(dtype)
        flat = converted.view(-1)
        scratch = _scratch_for(source, scratch)
        magnitudes = torch.bitwise_and(
            flat.view(torch.int16), _MAGNITUDE_BITS, out=scratch[: source.numel()]
        )
        if source.numel() > _FEW or int(magnitudes.min()) == 0:
            _lift_flushed_blocks(source.view(-1), flat, magnitudes)
        return converted
    converted = torch.empty_like(source, dtype=dtype)
    if source.dim() == 0 or not source.is_contiguous():  # rare: full-size temporaries
        converted.copy_(source)  # (torch gives a 0-d nan other bits than a 1-d copy would)
        whole = (source.view(1), converted.view(1)) if source.dim() == 0 else (source, converted)
        _lift_flushed(*whole, whole[1].view(torch.int16) & _MAGNITUDE_BITS)
        return converted
    flat_source, flat_converted = source.reshape(-1), converted.view(-1)
    scratch = _scratch_for(source, scratch)
    for start in range(0, source.numel(), _CHUNK):
        end = min(start + _CHUNK, source.numel())
        _convert_chunk(flat_source[start:end], flat_converted[start:end], scratch[: end - start])
    return converted


def convert_in_place(
    tensor: torch.Tensor,
    dtype: torch.dtype,
    scratch: torch.Tensor | None = None,
    may_flush: bool = True,
) -> torch.Tensor:
    """``tensor_to_fp16(tensor, dtype, ...)`` written over ``tensor``'s own memory, for a
    contiguous tensor of another dtype as wide (a bf16 weight made fp16): returns the
    converted tensor, a ``dtype`` view of the same storage; ``tensor`` holds its bits
    after. Each element is read before its own two bytes are written, as an in-place
    elementwise op reads and writes them, so no memory is allocated for the result: no
    fresh pages, whose faults cost a plain conversion more than the conversion itself.
    Where an element ``may_flush``, each chunk of the original is kept in a cache-sized
    buffer until its flushed elements are found and lifted. The caller owns the
    storage: nothing else may read it."""
    source = tensor.detach()
    converted = source.view(dtype)
    count = source.numel()
    if not may_flush or not count:
        converted.copy_(source)
        return converted
    flat_source, flat_converted = source.view(-1), converted.view(-1)
    kept = torch.empty(min(_CHUNK, count), dtype=source.dtype, device=source.device)
    scratch = _scratch_for(source, scratch)
    for start in range(0, count, _CHUNK):
        end = min(start + _CHUNK, count)
        original = kept[: end - start].copy_(flat_source[start:end])
        _convert_chunk(original, flat_converted[start:end], scratch[: end - start])
    return converted


def conversion_scratch(elements: int = 1 << 20, device: torch.device | str = "cpu") -> torch.Tensor:
    """A buffer ``tensor_to_fp16`` may reuse for a tensor of up to ``elements`` (any size
    from one chunk on) on ``device``."""
    return torch.empty(min(_CHUNK, elements), dtype=torch.int16, device=device)


def _scratch_for(source: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
    """``scratch`` where it lies on ``source``'s device, else a new one there."""
    if scratch is not None and scratch.device == source.device:
        return scratch
    return conversion_scratch(source.numel(), source.device)


# Elements per chunk: 4 MiB of fp32 and its 16-bit copy stay in the shared cache. The
# ops on a chunk are parallel inside torch, so chunks use every core too.
_CHUNK = 1 << 20
_MAGNITUDE_BITS = 0x7FFF  # a 16-bit float without its sign bit: 0 exactly for +-0.0
_BLOCK = 1 << 12  # zeros are located to blocks this small before they are indexed
# A tensor of at most this many elements is asked first whether it holds a zero at all:
# one in N(0, 0.02) flushes about one element in 800,000, so the answer is mostly no, and
# one minimum spares the blocks' reduction (a chunk of a million holds one, most often).
_FEW = 1 << 16


def _convert_chunk(source: torch.Tensor, converted: torch.Tensor, scratch: torch.Tensor) -> None:
    """``converted[:] = source`` for 1-d tensors, in 16 bits, with flushed nonzero
    elements lifted to +-the smallest subnormal (as rounding would give them if it
    did not flush). ``scratch``: as many int16 elements, overwritten.

    A flushed element is a +-0.0 in ``converted`` where ``source`` is not zero. Zeros
    are found with minimums over the magnitude bits (an integer minimum is vectorised,
    a float ``==`` or an argmin is ten times slower): see ``_lift_flushed_blocks``.
    """
    converted.copy_(source)
    magnitudes = torch.bitwise_and(converted.view(torch.int16), _MAGNITUDE_BITS, out=scratch)
    _lift_flushed_blocks(source, converted, magnitudes)


def _lift_flushed_blocks(source: torch.Tensor, converted: torch.Tensor, magnitudes) -> None:
    """Lift the flushed elements of 1-d ``converted`` (``magnitudes``: its magnitude
    bits). One reduction gives every ``_BLOCK``-element block's smallest magnitude, and
    the blocks that hold a zero are compared with the source together (a million
    weights drawn from N(0, 0.02) hold a few that flush, in a few blocks: most chunks
    hold one, so a first minimum over the whole chunk would rarely spare the blocks'
    reduction). The temporaries are the size of those blocks, so converting hundreds of
    weights leaves no holes in the heap."""
    count = magnitudes.numel()
    whole = count // _BLOCK * _BLOCK
    if whole:
        rows = magnitudes[:whole].view(-1, _BLOCK)
        blocks = rows.amin(1).eq(0).nonzero().view(-1)
        if blocks.numel():
            flushed = rows.index_select(0, blocks).eq(0)
            flushed.logical_and_(source[:whole].view(-1, _BLOCK).index_select(0, blocks).ne(0))
            row, column = flushed.nonzero(as_tuple=True)
            if row.numel():
                at = blocks[row] * _BLOCK + column
                converted[at] = _lifted(source[at], converted.dtype)
    if whole < count and int(magnitudes[whole:].min()) == 0:  # the tail, under a block
        _lift_flushed(source[whole:], converted[whole:], magnitudes[whole:])


def _lift_flushed(source: torch.Tensor, converted: torch.Tensor, magnitudes: torch.Tensor) -> None:
    """Lift every flushed element at once: ``magnitudes`` holds the magnitude bits of
    ``converted`` (0 where it is +-0.0), in its shape. Zeros of the source (a bias
    initialised to zero) cost two comparisons, not an index of every zero."""
    flushed = magnitudes.eq(0).logical_and_(source.ne(0))
    if bool(flushed.any()):
        converted[flushed] = _lifted(source[flushed], converted.dtype)


def _lifted(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """+-the smallest subnormal of ``dtype``, with the signs of ``values``."""
    tiny = torch.full_like(values, smallest_subnormal(dtype))
    return torch.copysign(tiny, values).to(dtype)
