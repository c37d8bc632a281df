"""The norm rewrites of ``StabilizePass``: RMSNorm and L2 norm scaled by a power of two,
the two-pass variance, and the opt-in eps clamp."""

import math

import torch
from torch.fx import Graph, Node

from fx16.meta import (
    BOUNDED_BELOW,
    NEGLIGIBLE,
    ROUNDING_CANCELS,
    SCALAR_ROUNDS_EXACTLY,
    SCALED,
)
from fx16.ops.numerics import smallest_normal
from fx16.passes.stable_rewrites.matching import (
    AT_LEAST_NORMAL,
    Builder,
    Rewrite,
    calls,
    mean_of,
    only_user,
    power_of_two_below,
    reduction_of,
    squared,
)
from fx16.passes.stable_rewrites.norm_statistic import ANY_SCALE, EpsTerm, compensated

aten = torch.ops.aten


# Why sqrt(eps) / f may be stored rounded to the 16-bit type: 2**-k is a power of two, and
# rounding is the same at every power of two while the product is normal; a subnormal
# product's square is below half the smallest subnormal, zero whichever way it rounded.
_SQRT_EPS_ROUNDS = (
    "sqrt(eps) / f times a power of two, then squared: the same 16-bit result with "
    "sqrt(eps) / f rounded to 16-bit"
)

# Why a scaled norm's values stay in range for any input.
_SCALED_MEAN = "a scaled RMSNorm's: |y| < 128 and y**2 < 16384 for any input"
_SCALED_SUM = "a scaled L2 norm's: |y| < 2, a sum of n squares below 4n, for any input"


# Why the scaled eps term may flush: it is tiny only where the scale s comes from the row's
# largest magnitude, and then the mean of squares it is added to is at least 64**2 / d.
_EPS_TERM = (
    "the eps term of a scaled RMSNorm, (sqrt(eps)/s)**2: where it is below 16-bit's normal "
    "range, s is a power of two within 2x of the row's largest magnitude over 64, and the "
    "mean of squares it is added to is at least 4096 / row length: flushing it changes "
    "that sum by under 1.5e-8 of it per element of the row"
)


# Why the scaled mean (or sum) of squares cannot flush: a row's largest |y| is at least 64
# (a sum's: 1) unless the row's largest |x| is below the clamp's floor, and then the eps
# term is eps * 4096 / floor**2; without an eps, such a row was subnormal in 16-bit before
# the norm.
_SCALED_POWER = (
    "the mean (or sum) of squares of a scaled norm: at least 4096 / row length (a sum: 1) "
    "where the row's largest magnitude is at least the clamp's floor (2**-8, a sum's "
    "2**-14, or sqrt(eps)'s power of two), else at least 1024, or eps * 2**28; without "
    "an eps, a row below that was subnormal in 16-bit before the norm"
)


class RmsNormScaling:
    """A norm of a row's squares divided through by a power of two near its largest magnitude.

    Before: ``x * rsqrt(mean(x**2, dims, keepdim=True) + eps)`` (RMSNorm), or
    ``x / sqrt(...)``, or the same over ``sum`` (an L2 normalization,
    ``x / sqrt(sum(x**2))``), with or without eps - with activations of a few hundred,
    x**2 passes 65504 (why models compute it in an fp32 region); on a quiet input (a
    near-silent audio frame) it flushes to zero.
    After: ``k = floor(log2(amax(max(|x|, floor), dims))); s = 2**k * f; y = x / s;
    y * rsqrt(mean(y**2, dims) + (2**-k * sqrt(eps) / f)**2)`` (``y / sqrt(...)`` for the
    divided form: a power of two scales every value it computes, so in range each rounds
    as the model's own form does): the same value in exact arithmetic for any s > 0, and
    s a power of two makes ``x / s`` exact in 16-bit too. The floor is 2**-14 / f, or the
    power of two at or above sqrt(eps) where that is larger: the eps term stays below
    2**14 on any row (a row below sqrt(eps) is eps's anyway).
    Inside an fp32 region the model opens (``x.float()`` before the variance, retargeted
    to 16-bit), the norm after y is computed as the fp32 form computes it, rounded once
    (``fx16.passes.stable_rewrites.norm_statistic``): the model asked for an fp32
    statistic, and a 16-bit rsqrt of a 16-bit mean rounds once per row for the whole row
    (1.3-1.5x ``.half()``'s error on the norm's output).
    For a mean, f = 1/64: the row's largest |y| lies in [64, 128), so every y**2 is below
    16384, and elements 1/2000 of the largest still square to a normal 16-bit number
    (scaling the largest to 1 would leave their squares subnormal, with a few bits). For
    a sum, f = 1: the largest |y| lies in [1, 2), so a row of up to 16000 squares stays
    below 65504. The scale's own rounding cannot matter (any s would do), which its nodes
    say in ``meta["fx16.rounding_cancels"]`` for the conditioning analysis.

    Costs: a clamp and a division per element, one largest-magnitude reduction per row,
    in 16-bit; no fp32 (in a model's fp32 region, a second mean and about 25 ops per
    element more)."""

    name = "rms_norm_scaling"
    roots = (aten.mul.Tensor, aten.div.Tensor)  # the ops a match starts from
    # the meta markers its replacement writes
    marks = (SCALED, ROUNDING_CANCELS, BOUNDED_BELOW, NEGLIGIBLE, SCALAR_ROUNDS_EXACTLY)

    def match(self, node: Node) -> Rewrite | None:
        if calls(node, aten.mul.Tensor):
            pairs = [(x, root) for x, root in (node.args, node.args[::-1])]
            pairs = [(x, root) for x, root in pairs if calls(root, aten.rsqrt.default)]
        elif calls(node, aten.div.Tensor) and calls(node.args[1], aten.sqrt.default):
            pairs = [tuple(node.args)]
        else:
            return None
        for x, root in pairs:
            if not only_user(root, node):
                continue
            reduced, eps, guard = root.args[0], None, ()
            if calls(reduced, aten.add.Tensor) and only_user(reduced, root):
                eps, guard, reduced = reduced.args[1], (reduced,), reduced.args[0]
                if not (isinstance(eps, float) and eps >= 0):
                    continue
            found = reduction_of(reduced)
            reader = guard[0] if guard else root
            if found is None or not found[2] or not only_user(reduced, reader):
                continue
            squares = found[0]
            if only_user(squares, reduced) and squared(squares) is x:
                replaced = (node, root, *guard, reduced, squares)
                detail = ("sum of squares, " if found[3] is aten.sum.dim_IntList else "") + (
                    f"eps {eps:g}" if eps is not None else "no eps"
                )
                return Rewrite(node, replaced, detail, parts=(x, reduced, eps))
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        x, reduced, eps = rewrite.parts
        _, dims, _, reduction = reduction_of(reduced)
        summed = reduction is aten.sum.dim_IntList
        factor = 1.0 if summed else 2.0**-6
        make = Builder(graph, rewrite.result)
        magnitudes = make(aten.abs.default, x)
        # max(amax(|x|), floor) as amax(max(|x|, floor)): the clamp runs beside
        # the abs, and every op from the row's largest magnitude to 2**k is one that
        # ExecuTorch's XNNPACK delegate leaves out, so the norm splits no delegate more
        lifted = make(aten.clamp.default, magnitudes, _floor(eps, factor))
        lifted.meta[BOUNDED_BELOW] = AT_LEAST_NORMAL
        largest = make(aten.amax.default, lifted, dims, True)
        exponent, power = power_of_two_below(
            make, largest, (magnitudes, lifted, largest), ANY_SCALE
        )
        scale = power if summed else make(aten.mul.Tensor, power, factor)
        scale.meta[ROUNDING_CANCELS] = ANY_SCALE
        scale.meta[BOUNDED_BELOW] = AT_LEAST_NORMAL
        y = make(aten.div.Tensor, x, scale)
        squares = make(aten.pow.Tensor_Scalar, y, 2)
        power_sum = make(reduction, squares, dims, True)
        why = _SCALED_SUM if summed else _SCALED_MEAN
        for part in (y, squares, power_sum):
            part.meta[SCALED] = why
        if rewrite.in_model_fp32:
            power_sum.meta[BOUNDED_BELOW] = _SCALED_POWER
            inverse = None if eps is None else make(aten.pow.Scalar, 0.5, exponent)
            if inverse is not None:
                inverse.meta[ROUNDING_CANCELS] = ANY_SCALE  # 2**-k, from the same k as 2**k
            eps_term = None if eps is None else EpsTerm(eps / factor**2, inverse)
            return compensated(make, y, power_sum, dims, eps_term, summed)
        if eps is not None:
            # sqrt(eps) / s = 2**-k * (sqrt(eps) / f), 2**-k read from k as 2**k is
            inverse = make(aten.pow.Scalar, 0.5, exponent)
            inverse.meta[ROUNDING_CANCELS] = ANY_SCALE  # 1/s, from the same k as s
            shrunk = make(aten.mul.Tensor, inverse, math.sqrt(eps) / factor)
            eps_term = make(aten.mul.Tensor, shrunk, shrunk)
            for small in (shrunk, eps_term):
                small.meta[NEGLIGIBLE] = _EPS_TERM
            shrunk.meta[SCALAR_ROUNDS_EXACTLY] = _SQRT_EPS_ROUNDS
            power_sum = make(aten.add.Tensor, power_sum, eps_term)
            power_sum.meta[SCALED] = why  # eps_term below 2**28 eps
        power_sum.meta[BOUNDED_BELOW] = _SCALED_POWER
        if rewrite.result.target is aten.div.Tensor:  # the model's own form, rounding alike
            return make(aten.div.Tensor, y, make(aten.sqrt.default, power_sum))
        return make(aten.mul.Tensor, y, make(aten.rsqrt.default, power_sum))


def _floor(eps: float | None, factor: float) -> float:
    """The clamp under a row's largest magnitude: 16-bit's smallest normal over f, or the
    power of two at or above sqrt(eps) where that is larger."""
    floor = 2.0**-14 / factor
    if eps:
        floor = max(floor, 2.0 ** math.ceil(math.log2(math.sqrt(eps))))
    return floor


class TwoPassVariance:
    """Before: ``mean(x**2) - mean(x)**2`` - two large, nearly equal terms: their
    difference cancels to noise (or below 0) when the mean is large against the spread.
    After: ``var(x, dims, correction=0)``, which subtracts the mean first.

    Costs: one more elementwise pass over the values (the subtraction of their mean), in
    16-bit."""

    name = "two_pass_variance"
    roots = (aten.sub.Tensor,)  # the ops a match starts from
    marks = ()  # the meta markers its replacement writes

    def match(self, node: Node) -> Rewrite | None:
        if not calls(node, aten.sub.Tensor) or node.kwargs.get("alpha", 1) != 1:
            return None
        squares, square_of_mean = node.args
        first, mean_node = mean_of(squares), squared(square_of_mean)
        second = mean_of(mean_node)
        if first is None or second is None:
            return None
        x = squared(first[0])
        if x is None or x is not second[0] or first[1:] != second[1:]:
            return None
        parts = (squares, first[0], square_of_mean, mean_node)
        if not all(len(part.users) == 1 for part in parts if part is not mean_node):
            return None
        if len(mean_node.users) != (2 if square_of_mean.target is aten.mul.Tensor else 1):
            return None
        return Rewrite(node, (node, *parts))

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        node = rewrite.result
        x, dims, keepdim = mean_of(node.args[1].args[0])
        return Builder(graph, node)(aten.var.correction, x, dims, correction=0, keepdim=keepdim)


class EpsClamp:
    """Before: ``rsqrt(v + eps)`` or ``x / (norm + eps)`` with 0 < eps below the 16-bit
    dtype's smallest normal (fp16: 6.1e-5): in 16-bit eps flushes to a subnormal or 0,
    and a zero v gives inf. After: eps raised to that smallest normal. This one changes
    the result: where v (or norm) is below the new eps the output differs; the detail
    states both values.

    Costs: nothing at run time; it changes results where the sum is below the new eps,
    hence opt-in."""

    name = "eps_clamp"
    roots = (aten.rsqrt.default, aten.div.Tensor)  # the ops a match starts from
    marks = ()  # the meta markers its replacement writes

    def __init__(self, low: torch.dtype) -> None:
        self.smallest = smallest_normal(low)

    def match(self, node: Node) -> Rewrite | None:
        if calls(node, aten.rsqrt.default):
            added = node.args[0]
        elif calls(node, aten.div.Tensor):
            added = node.args[1]
        else:
            return None
        if not (calls(added, aten.add.Tensor) and only_user(added, node)):
            return None
        eps = added.args[1]
        if isinstance(eps, float) and 0 < eps < self.smallest and isinstance(added.args[0], Node):
            detail = f"eps {eps:g} -> {self.smallest:.3g}: differs where the sum is below it"
            return Rewrite(node, (node, added), detail)
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        node = rewrite.result
        added = node.args[0] if node.target is aten.rsqrt.default else node.args[1]
        make = Builder(graph, node)
        clamped = make(aten.add.Tensor, added.args[0], self.smallest)
        if node.target is aten.rsqrt.default:
            return make(aten.rsqrt.default, clamped)
        return make(aten.div.Tensor, node.args[0], clamped)
