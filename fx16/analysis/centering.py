"""Ops that subtract a center: normalizations, var and std inside them, and an
explicit subtraction of a per-slice statistic (``x - mean(x, 0, keepdim=True)``).

``batch_norm`` subtracts ``running_mean`` (or the batch's mean), ``layer_norm``,
``group_norm`` and ``instance_norm`` the mean of each group they normalize, ``var``
and ``std`` the mean along their dims. Rounding the input to 16-bit happens before
that subtraction, so it cancels as an explicit ``x - mean`` does: features of
4096 +- 2 rounded to fp16's spacing of 4 come out of the norm as noise.

A subtraction ``a - b`` where one operand is broadcast along some dims (a per-column
mean, a per-channel running mean, a per-row maximum) centres each slice along those
dims on its own: standardizing columns of different units, one wide and centred and
one with a large offset and a small spread, cancels three orders of magnitude in the
narrow column, which one ratio over the whole tensor (the wide column's) hides.

The cancellation ratio of one group is max |x| / max |x - center|: the 16-bit
rounding of the input (relative to max |x|) over the output's scale (the largest
deviation). It is about 1 for centred data and |mean| / spread for offset data;
the op's ratio is the largest over its groups. A group that is constant up to fp32's
own rounding (a constant row or column) is left out: 16-bit rounds its every element
alike, and what fp32 computes of it is rounding noise too. ``centered_input`` reads where an
op keeps its input, center and groups (data: ``_LAYOUTS``), ``cancellation_ratio``
measures it on real tensors (calibration), ``buffer_ratio`` estimates it from a
batch norm's running statistics alone, |running_mean| / sqrt(running_var).
"""

import math
from dataclasses import dataclass

import torch

from fx16.ops.numeric_tables import VARIANCE_OPS
from fx16.ops.tables import overloads


@dataclass(frozen=True)
class Centered:
    """What an op centres: ``values`` grouped along ``dims``, minus ``center`` (None:
    the group's mean)."""

    values: torch.Tensor
    dims: tuple[int, ...]
    center: torch.Tensor | None = None


def _layer_norm(args) -> Centered:  # (input, normalized_shape, ...)
    x = args[0]
    return Centered(x, tuple(range(x.dim() - len(args[1]), x.dim())))


def _group_norm(args) -> Centered:  # (input, num_groups, ...)
    x = args[0]
    return Centered(x.reshape(x.shape[0], args[1], -1), (2,))


def _native_group_norm(args) -> Centered:  # (input, weight, bias, N, C, HxW, group, eps)
    x = args[0]
    return Centered(x.reshape(x.shape[0], args[6], -1), (2,))


def _per_channel(x: torch.Tensor, center: torch.Tensor | None) -> Centered:
    dims = tuple(d for d in range(x.dim()) if d != 1)
    if center is not None:
        center = center.reshape([1, -1] + [1] * (x.dim() - 2))
    return Centered(x, dims, center)


def _batch_norm(args) -> Centered:  # (input, weight, bias, running_mean, running_var, training)
    training = args[5] if len(args) > 5 and isinstance(args[5], bool) else False
    return _per_channel(args[0], None if training or args[3] is None else args[3])


def _batch_norm_no_training(args) -> Centered:  # (input, weight, bias, running_mean, ...)
    return _per_channel(args[0], args[3])


def _batch_norm_no_stats(args) -> Centered:  # (input, weight, bias, training, ...)
    return _per_channel(args[0], None)


def _instance_norm(args) -> Centered:  # (input, ...): each sample's channel on its own
    x = args[0]
    return Centered(x, tuple(range(2, x.dim())))


def _variance(args) -> Centered:  # (input, dim, ...): dim None is every dim
    x = args[0]
    dims = args[1] if len(args) > 1 and args[1] is not None else range(x.dim())
    dims = (dims,) if isinstance(dims, int) else dims
    return Centered(x, tuple(d % x.dim() for d in dims) if x.dim() else ())


def _subtraction(args) -> Centered | None:  # (a, b): a - b, centred per slice
    a, b = args[0], args[1]
    if not isinstance(b, torch.Tensor) or a.shape == b.shape:
        return None
    a, b = torch.broadcast_tensors(a, b)
    original = args[0].shape, args[1].shape
    dims = tuple(
        d
        for d in range(a.dim())
        if a.shape[d] > 1 and any(_broadcast(s, d, a.dim()) for s in original)
    )
    if not dims or len(dims) == sum(size > 1 for size in a.shape):  # no slices, or one
        return None
    return Centered(a, dims, b)


def _broadcast(shape: torch.Size, dim: int, rank: int) -> bool:
    """Whether an operand of ``shape`` is broadcast along ``dim`` of a rank-``rank`` result."""
    own = dim - (rank - len(shape))
    return own < 0 or shape[own] == 1


_LAYOUTS = {
    **dict.fromkeys(overloads("layer_norm.default", "native_layer_norm.default"), _layer_norm),
    **dict.fromkeys(overloads("group_norm.default"), _group_norm),
    **dict.fromkeys(overloads("native_group_norm.default"), _native_group_norm),
    **dict.fromkeys(
        overloads(
            "batch_norm.default",
            "native_batch_norm.default",
            "_native_batch_norm_legit.default",
            "_native_batch_norm_legit_functional.default",
        ),
        _batch_norm,
    ),
    **dict.fromkeys(
        overloads("_native_batch_norm_legit_no_training.default"), _batch_norm_no_training
    ),
    **dict.fromkeys(overloads("_native_batch_norm_legit.no_stats"), _batch_norm_no_stats),
    **dict.fromkeys(overloads("instance_norm.default"), _instance_norm),
    **dict.fromkeys(
        VARIANCE_OPS
        | overloads(
            "var_mean.default",
            "var_mean.dim",
            "var_mean.correction",
            "std_mean.default",
            "std_mean.dim",
            "std_mean.correction",
        ),
        _variance,
    ),
    **dict.fromkeys(overloads("sub.Tensor"), _subtraction),
}

# The ops that subtract a center: a mean inside them, or a per-slice statistic.
CENTERING_OPS = frozenset(_LAYOUTS)

_INFERENCE_BATCH_NORMS = overloads("_native_batch_norm_legit_no_training.default")
_BATCH_NORMS = overloads(
    "batch_norm.default", "native_batch_norm.default", "_native_batch_norm_legit.default"
)


def centered_input(target, args: tuple) -> Centered | None:
    """What the op ``target`` centres, given its (real or fake) arguments."""
    layout = _LAYOUTS.get(target)
    if layout is None or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        return None
    return layout(args)


def running_statistics(target, args: tuple) -> tuple | None:
    """(running_mean, running_var) of a batch norm in inference, else None."""
    inference = target in _INFERENCE_BATCH_NORMS or (
        target in _BATCH_NORMS and len(args) > 5 and args[5] is False
    )
    return (args[3], args[4]) if inference else None


# A group whose deviation is within this many of fp32's roundings of its largest
# magnitude is constant: what fp32 computes of its deviation is rounding noise.
_FP32_NOISE = 16 * torch.finfo(torch.float32).eps


def cancellation_ratio(centered: Centered) -> float:
    """The largest max |x| / max |x - center| over the groups (1 where nothing deviates)."""
    x = centered.values.detach().float()
    if not x.numel() or not centered.dims:
        return 1.0
    center = centered.center
    if center is None:
        center = x.mean(centered.dims, keepdim=True)
    largest = x.abs().amax(centered.dims)
    deviation = (x - center.float()).abs().amax(centered.dims)
    deviates = deviation > largest * _FP32_NOISE  # else constant up to fp32's rounding
    ratios = torch.where(deviates, largest / deviation, 1.0)
    ratio = float(ratios.max()) if ratios.numel() else 1.0
    return ratio if math.isfinite(ratio) else 1.0


def buffer_ratio(mean: torch.Tensor, variance: torch.Tensor, eps: float = 1e-5) -> float:
    """|running_mean| / sqrt(running_var + eps), the largest over the channels."""
    ratios = mean.detach().float().abs() / (variance.detach().float() + eps).sqrt()
    return float(ratios.max()) if ratios.numel() else 1.0
