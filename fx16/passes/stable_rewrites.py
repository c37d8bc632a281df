"""The rules of ``StabilizePass``: each matches one pattern 16-bit spoils and builds an
equivalent that computes well in it (its docstring shows before and after)."""

import math
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fx16.casts import copy_provenance
from fx16.meta import NEGLIGIBLE, ROUNDING_CANCELS
from fx16.numerics import smallest_normal
from fx16.propagation import propagate_fake

aten = torch.ops.aten


def _is(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _only_user(node: Node, user: Node) -> bool:
    return len(node.users) == 1 and user in node.users


def _scalar(value, expected: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == expected


def _squared(node) -> Node | None:
    """x for ``pow(x, 2)`` or ``x * x``."""
    if _is(node, aten.pow.Tensor_Scalar) and _scalar(node.args[1], 2):
        return node.args[0]
    if _is(node, aten.mul.Tensor) and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _mean(node) -> tuple[Node, list, bool] | None:
    """(x, dims, keepdim) for ``mean(x, dims, keepdim)``."""
    if _is(node, aten.mean.dim) and isinstance(node.args[0], Node):
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return node.args[0], list(node.args[1]), bool(keepdim)
    return None


class _Builder:
    """Makes the replacement's nodes before ``anchor``, each with its fake value and the
    anchor's provenance (module path, source line)."""

    def __init__(self, graph: Graph, anchor: Node) -> None:
        self.graph, self.anchor = graph, anchor

    def __call__(self, target, *args, **kwargs) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = propagate_fake(node)
        copy_provenance(self.anchor, node)
        return node


@dataclass(frozen=True)
class Rewrite:
    """What a rule found: the node whose result it replaces, the nodes only that
    result used (removed with it), and how to build the replacement."""

    result: Node
    replaced: tuple[Node, ...]
    detail: str = ""


class RmsNormScaling:
    """RMSNorm's variance divided through by a power of two near the row's largest magnitude.

    Before: ``x * rsqrt(mean(x**2, dims, keepdim=True) + eps)`` - with activations of
    a few hundred, x**2 passes 65504 (why models compute it in an fp32 region).
    After: ``s = 2**floor(log2(max(amax(|x|, dims) / 64, 2**-14))); y = x / s;
    y * rsqrt(mean(y**2, dims) + (sqrt(eps) / s)**2)``: the same value in exact
    arithmetic for any s > 0, and s a power of two makes ``x / s`` exact in 16-bit too.
    The row's largest |y| lies in [64, 128), so every y**2 is below 16384, and elements
    1/2000 of the largest still square to a normal 16-bit number (scaling the largest
    to 1 would leave their squares subnormal, with a few bits). The scale's own rounding
    cannot matter (any s would do), which its nodes say in ``meta["fx16.rounding_cancels"]``
    for the conditioning analysis."""

    name = "rms_norm_scaling"

    def match(self, node: Node) -> Rewrite | None:
        if not _is(node, aten.mul.Tensor):
            return None
        for x, root in (node.args, reversed(node.args)):
            if not _is(root, aten.rsqrt.default) or not _only_user(root, node):
                continue
            added = root.args[0]
            if not (_is(added, aten.add.Tensor) and _only_user(added, root)):
                continue
            mean, eps = added.args[0], added.args[1]
            if not isinstance(eps, float) or eps < 0 or not _only_user(mean, added):
                continue
            found = _mean(mean)
            if found is None or not found[2] or not _only_user(found[0], mean):
                continue
            if _squared(found[0]) is x:
                return Rewrite(node, (node, root, added, mean, found[0]), f"eps {eps:g}")
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        node = rewrite.result
        root = next(arg for arg in node.args if _is(arg, aten.rsqrt.default))
        x = next(arg for arg in node.args if arg is not root)
        added = root.args[0]
        eps = added.args[1]
        _, dims, _ = _mean(added.args[0])
        make = _Builder(graph, node)
        magnitudes = make(aten.abs.default, x)
        largest = make(aten.amax.default, magnitudes, dims, True)
        clamped = make(aten.clamp.default, make(aten.mul.Tensor, largest, 2.0**-6), 2.0**-14)
        exponent = make(aten.floor.default, make(aten.log2.default, clamped))
        scale = make(aten.exp2.default, exponent)
        for part in (magnitudes, largest, clamped, exponent, exponent.args[0], scale):
            part.meta[ROUNDING_CANCELS] = _ANY_SCALE
        y = make(aten.div.Tensor, x, scale)
        mean = make(aten.mean.dim, make(aten.pow.Tensor_Scalar, y, 2), dims, True)
        shrunk = make(aten.mul.Tensor, make(aten.reciprocal.default, scale), math.sqrt(eps))
        eps_term = make(aten.mul.Tensor, shrunk, shrunk)
        for small in (shrunk, eps_term):
            small.meta[NEGLIGIBLE] = _EPS_TERM
        inverse = make(aten.rsqrt.default, make(aten.add.Tensor, mean, eps_term))
        return make(aten.mul.Tensor, y, inverse)


# Why the scale's rounding does not matter: the result is the same for any s > 0.
_ANY_SCALE = (
    "the scale s of a scaled RMSNorm: the result is the same for any s > 0, so its rounding "
    "(a power of two a step off) cancels"
)

# Why the scaled eps term may flush: it is tiny only where the scale s comes from the row's
# largest magnitude, and then the mean of squares it is added to is at least 64**2 / d.
_EPS_TERM = (
    "the eps term of a scaled RMSNorm, (sqrt(eps)/s)**2: where it is below 16-bit's normal "
    "range, s is a power of two within 2x of the row's largest magnitude over 64, and the "
    "mean of squares it is added to is at least 4096 / row length: flushing it changes "
    "that sum by under 1.5e-8 of it per element of the row"
)


class LogSoftmax:
    """Before: ``log(softmax(x, dim))`` - probabilities below 6e-8 flush to 0 in fp16,
    and their log to -inf. After: ``log_softmax(x, dim)``, which never forms them."""

    name = "log_softmax"

    def match(self, node: Node) -> Rewrite | None:
        inner = node.args[0] if _is(node, aten.log.default) else None
        if _is(inner, aten.softmax.int, aten._softmax.default) and _only_user(inner, node):
            return Rewrite(node, (node, inner))
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        softmax = rewrite.result.args[0]
        x, dim = softmax.args[0], softmax.args[1]
        return _Builder(graph, rewrite.result)(aten._log_softmax.default, x, dim, False)


class LogSigmoid:
    """Before: ``log(sigmoid(x))`` - sigmoid of x below -17 is 0 in fp16, its log -inf.
    After: ``min(x, 0) - log1p(exp(-|x|))``, the same function: exp never overflows
    and log1p keeps the small term, so it is finite and accurate wherever x is."""

    name = "log_sigmoid"

    def match(self, node: Node) -> Rewrite | None:
        inner = node.args[0] if _is(node, aten.log.default) else None
        if _is(inner, aten.sigmoid.default) and _only_user(inner, node):
            return Rewrite(node, (node, inner))
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        make = _Builder(graph, rewrite.result)
        x = rewrite.result.args[0].args[0]
        small = make(aten.exp.default, make(aten.neg.default, make(aten.abs.default, x)))
        return make(
            aten.sub.Tensor,
            make(aten.clamp.default, x, None, 0.0),
            make(aten.log1p.default, small),
        )


class Log1p:
    """Before: ``log(x + 1)`` - for |x| below 16-bit's epsilon, 1 + x rounds to 1 and
    the result to 0. After: ``log1p(x)``, accurate for small x."""

    name = "log1p"

    def match(self, node: Node) -> Rewrite | None:
        inner = node.args[0] if _is(node, aten.log.default) else None
        if not (_is(inner, aten.add.Tensor) and _only_user(inner, node)):
            return None
        alpha = inner.kwargs.get("alpha", 1)
        if _scalar(inner.args[1], 1) and alpha == 1 and isinstance(inner.args[0], Node):
            return Rewrite(node, (node, inner))
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        x = rewrite.result.args[0].args[0]
        return _Builder(graph, rewrite.result)(aten.log1p.default, x)


class Expm1:
    """Before: ``exp(x) - 1`` - for small x, exp(x) rounds to 1 and the difference to 0
    or a multiple of 16-bit's epsilon. After: ``expm1(x)``, accurate for small x."""

    name = "expm1"

    def match(self, node: Node) -> Rewrite | None:
        if not (_is(node, aten.sub.Tensor) and _scalar(node.args[1], 1)):
            return None
        inner = node.args[0]
        if node.kwargs.get("alpha", 1) == 1 and _is(inner, aten.exp.default):
            if _only_user(inner, node):
                return Rewrite(node, (node, inner))
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        x = rewrite.result.args[0].args[0]
        return _Builder(graph, rewrite.result)(aten.expm1.default, x)


class TwoPassVariance:
    """Before: ``mean(x**2) - mean(x)**2`` - two large, nearly equal terms: their
    difference cancels to noise (or below 0) when the mean is large against the spread.
    After: ``var(x, dims, correction=0)``, which subtracts the mean first."""

    name = "two_pass_variance"

    def match(self, node: Node) -> Rewrite | None:
        if not _is(node, aten.sub.Tensor) or node.kwargs.get("alpha", 1) != 1:
            return None
        squares, square_of_mean = node.args
        first, mean_node = _mean(squares), _squared(square_of_mean)
        second = _mean(mean_node)
        if first is None or second is None:
            return None
        x = _squared(first[0])
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
        x, dims, keepdim = _mean(node.args[1].args[0])
        return _Builder(graph, node)(aten.var.correction, x, dims, correction=0, keepdim=keepdim)


class EpsClamp:
    """Before: ``rsqrt(v + eps)`` or ``x / (norm + eps)`` with 0 < eps below the 16-bit
    dtype's smallest normal (fp16: 6.1e-5): in 16-bit eps flushes to a subnormal or 0,
    and a zero v gives inf. After: eps raised to that smallest normal. This one changes
    the result: where v (or norm) is below the new eps the output differs; the detail
    states both values."""

    name = "eps_clamp"

    def __init__(self, low: torch.dtype) -> None:
        self.smallest = smallest_normal(low)

    def match(self, node: Node) -> Rewrite | None:
        if _is(node, aten.rsqrt.default):
            added = node.args[0]
        elif _is(node, aten.div.Tensor):
            added = node.args[1]
        else:
            return None
        if not (_is(added, aten.add.Tensor) and _only_user(added, node)):
            return None
        eps = added.args[1]
        if isinstance(eps, float) and 0 < eps < self.smallest and isinstance(added.args[0], Node):
            detail = f"eps {eps:g} -> {self.smallest:.3g}: differs where the sum is below it"
            return Rewrite(node, (node, added), detail)
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        node = rewrite.result
        added = node.args[0] if node.target is aten.rsqrt.default else node.args[1]
        make = _Builder(graph, node)
        clamped = make(aten.add.Tensor, added.args[0], self.smallest)
        if node.target is aten.rsqrt.default:
            return make(aten.rsqrt.default, clamped)
        return make(aten.div.Tensor, node.args[0], clamped)
