"""The rules of ``StabilizePass``: each matches one pattern 16-bit spoils and builds an
equivalent that computes well in it (its docstring shows before and after)."""

import math
from dataclasses import dataclass

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
from fx16.passes.polynomials import read_polynomial
from fx16.program.casts import copy_provenance
from fx16.program.nodes import is_float_tensor, is_number, node_val
from fx16.program.propagation import fresh_result

aten = torch.ops.aten


def _is(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _only_user(node: Node, user: Node) -> bool:
    return len(node.users) == 1 and user in node.users


def _scalar(value, expected: float) -> bool:
    return is_number(value) and value == expected


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
        node.meta["val"] = fresh_result(node)  # every op it makes computes a new tensor
        copy_provenance(self.anchor, node)
        return node


@dataclass(frozen=True)
class Rewrite:
    """What a rule found: the node whose result it replaces, the nodes only that
    result used (removed with it), and how to build the replacement."""

    result: Node
    replaced: tuple[Node, ...]
    detail: str = ""
    parts: tuple = ()  # what the rule's build reads, where the match found it


class RmsNormScaling:
    """A norm of a row's squares divided through by a power of two near its largest magnitude.

    Before: ``x * rsqrt(mean(x**2, dims, keepdim=True) + eps)`` (RMSNorm), or
    ``x / sqrt(...)``, or the same over ``sum`` (an L2 normalization,
    ``x / sqrt(sum(x**2))``), with or without eps - with activations of a few hundred,
    x**2 passes 65504 (why models compute it in an fp32 region); on a quiet input (a
    near-silent audio frame) it flushes to zero.
    After: ``k = floor(log2(amax(max(|x|, 2**-14 / f), dims))); s = 2**k * f; y = x / s;
    y * rsqrt(mean(y**2, dims) + (2**-k * sqrt(eps) / f)**2)`` (``y / sqrt(...)`` for the
    divided form: a power of two scales every value it computes, so in range each rounds
    as the model's own form does): the same value in exact arithmetic for any s > 0, and
    s a power of two makes ``x / s`` exact in 16-bit too.
    For a mean, f = 1/64: the row's largest |y| lies in [64, 128), so every y**2 is below
    16384, and elements 1/2000 of the largest still square to a normal 16-bit number
    (scaling the largest to 1 would leave their squares subnormal, with a few bits). For
    a sum, f = 1: the largest |y| lies in [1, 2), so a row of up to 16000 squares stays
    below 65504. The scale's own rounding cannot matter (any s would do), which its nodes
    say in ``meta["fx16.rounding_cancels"]`` for the conditioning analysis.

    Costs: a clamp and a division per element, one largest-magnitude reduction per row,
    in 16-bit; no fp32."""

    name = "rms_norm_scaling"
    roots = (aten.mul.Tensor, aten.div.Tensor)  # the ops a match starts from

    def match(self, node: Node) -> Rewrite | None:
        if _is(node, aten.mul.Tensor):
            pairs = [(x, root) for x, root in (node.args, node.args[::-1])]
            pairs = [(x, root) for x, root in pairs if _is(root, aten.rsqrt.default)]
        elif _is(node, aten.div.Tensor) and _is(node.args[1], aten.sqrt.default):
            pairs = [tuple(node.args)]
        else:
            return None
        for x, root in pairs:
            if not _only_user(root, node):
                continue
            reduced, eps, guard = root.args[0], None, ()
            if _is(reduced, aten.add.Tensor) and _only_user(reduced, root):
                eps, guard, reduced = reduced.args[1], (reduced,), reduced.args[0]
                if not (isinstance(eps, float) and eps >= 0):
                    continue
            found = _reduction(reduced)
            reader = guard[0] if guard else root
            if found is None or not found[2] or not _only_user(reduced, reader):
                continue
            squares = found[0]
            if _only_user(squares, reduced) and _squared(squares) is x:
                replaced = (node, root, *guard, reduced, squares)
                detail = ("sum of squares, " if found[3] is aten.sum.dim_IntList else "") + (
                    f"eps {eps:g}" if eps is not None else "no eps"
                )
                return Rewrite(node, replaced, detail, parts=(x, reduced, eps))
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        x, reduced, eps = rewrite.parts
        _, dims, _, reduction = _reduction(reduced)
        summed = reduction is aten.sum.dim_IntList
        factor = 1.0 if summed else 2.0**-6
        make = _Builder(graph, rewrite.result)
        magnitudes = make(aten.abs.default, x)
        # max(amax(|x|), 2**-14 / f) as amax(max(|x|, 2**-14 / f)): the clamp runs beside
        # the abs, and every op from the row's largest magnitude to 2**k is one that
        # ExecuTorch's XNNPACK delegate leaves out, so the norm splits no delegate more
        lifted = make(aten.clamp.default, magnitudes, 2.0**-14 / factor)
        lifted.meta[BOUNDED_BELOW] = _AT_LEAST_NORMAL
        largest = make(aten.amax.default, lifted, dims, True)
        exponent, power = _power_of_two_below(
            make, largest, (magnitudes, lifted, largest), _ANY_SCALE
        )
        scale = power if summed else make(aten.mul.Tensor, power, factor)
        scale.meta[ROUNDING_CANCELS] = _ANY_SCALE
        scale.meta[BOUNDED_BELOW] = _AT_LEAST_NORMAL
        y = make(aten.div.Tensor, x, scale)
        squares = make(aten.pow.Tensor_Scalar, y, 2)
        power_sum = make(reduction, squares, dims, True)
        why = _SCALED_SUM if summed else _SCALED_MEAN
        for part in (y, squares, power_sum):
            part.meta[SCALED] = why
        if eps is not None:
            # sqrt(eps) / s = 2**-k * (sqrt(eps) / f), 2**-k read from k as 2**k is
            inverse = make(aten.pow.Scalar, 0.5, exponent)
            inverse.meta[ROUNDING_CANCELS] = _ANY_SCALE  # 1/s, from the same k as s
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


def _reduction(node) -> tuple[Node, list, bool, object] | None:
    """(x, dims, keepdim, op) for ``mean(x, dims, keepdim)`` or ``sum(x, dims, keepdim)``."""
    if _is(node, aten.sum.dim_IntList) and isinstance(node.args[0], Node):
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if node.kwargs.get("dtype") is None and (len(node.args) < 4 or node.args[3] is None):
            return node.args[0], list(node.args[1]), bool(keepdim), node.target
        return None
    found = _mean(node)
    return None if found is None else (*found, node.target)


def _power_of_two_below(
    make: _Builder, largest: Node, parts, why: str, exponent_of=None
) -> tuple[Node, Node]:
    """(k, 2**k) for ``k = floor(log2(largest))`` (or ``exponent_of(make, k)``, a chain of
    nodes that makes another integer of it): a power of two (dividing by it is exact in
    16-bit) within 2x below ``largest``, which the caller keeps at least 16-bit's
    smallest normal (so k is finite where ``largest`` is). Its nodes and ``parts`` (what
    ``largest`` is computed from) say ``why`` their rounding cancels.

    The floor is ``div(log2(largest), 1, rounding_mode="floor")`` and the power
    ``pow(2.0, k)``, exact for an integer k: ops that ExecuTorch's XNNPACK delegate
    leaves out, like ``amax`` and ``log2``, so the whole chain runs outside it in one
    piece (an ``aten.floor``, which XNNPACK takes, made it a one-op delegate call of its
    own), and that ExecuTorch's kernels have (not ``exp2``: a program with one lowers but
    fails to run there)."""
    logarithm = make(aten.log2.default, largest)
    exponent = make(aten.div.Tensor_mode, logarithm, 1.0, rounding_mode="floor")
    chain = [logarithm, exponent]
    if exponent_of is not None:
        exponent = exponent_of(make, exponent)
        chain.extend(_made_since(make, exponent, chain[-1]))
    power = make(aten.pow.Scalar, 2.0, exponent)
    for part in (*parts, *chain, power):
        part.meta[ROUNDING_CANCELS] = why
    for bounded in (largest, power):
        bounded.meta[BOUNDED_BELOW] = _AT_LEAST_NORMAL
    return exponent, power


def _made_since(make: _Builder, last: Node, first: Node) -> list[Node]:
    """The nodes ``make`` put in its graph after ``first``, up to and with ``last``."""
    nodes, node = [], last
    while node is not first:
        nodes.append(node)
        node = node.prev
    return nodes


_AT_LEAST_NORMAL = "at least 2**-14, 16-bit's smallest normal"


class MagnitudeScaling:
    """A complex magnitude computed from its parts, divided through by a power of two
    where its largest part squares out of 16-bit's range.

    Before: ``sqrt(a**2 + b**2)`` (an STFT's magnitude from its real and imaginary
    parts) - parts above 181 square past 65504, and a quiet signal's parts below 2.4e-4
    square to 16-bit's subnormals or zero. After: ``P = amax(max(|a|, |b|, 2**-14))``
    over the whole tensor, ``e = floor(log2(P))``, ``s = 2**e`` where e < 0, ``2**(e - 6)``
    where e > 6, else 1; ``sqrt((a/s)**2 + (b/s)**2) * s``: the same value in exact
    arithmetic for any s > 0 (the scaling of ``hypot``). The largest part over s lies
    below 128, so no square passes 16384; a quiet tensor's largest lies in [1, 2).

    One scale for the whole tensor, and none where its largest part is in [1, 128):
    there the result is the plain form's, bit for bit. An elementwise scale would
    compute every bin exactly, the 16-bit rounding noise of a product in a bin that is
    empty too (an STFT of a constant stretch of audio): the magnitude turns that signed
    noise into a positive bias, which the next layer sums. The plain form flushes the
    squares of noise that far below the tensor's largest part, and so does this one at
    every loudness. A batch whose samples differ in loudness takes its loudest sample's
    scale.

    Costs: a largest magnitude of the two operands, one reduction over the tensor and
    two divisions, in 16-bit; no fp32."""

    name = "magnitude_scaling"
    roots = (aten.sqrt.default,)  # the ops a match starts from

    def match(self, node: Node) -> Rewrite | None:
        if not _is(node, aten.sqrt.default):
            return None
        added = node.args[0]
        if not (_is(added, aten.add.Tensor) and _only_user(added, node)):
            return None
        if added.kwargs.get("alpha", 1) != 1 or not all(isinstance(a, Node) for a in added.args):
            return None
        squares = added.args[:2]
        parts = tuple(_squared(square) for square in squares)
        if None in parts or squares[0] is squares[1]:
            return None
        if not all(_only_user(square, added) for square in squares):
            return None
        return Rewrite(node, (node, added, *squares), parts=parts)

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        a, b = rewrite.parts
        make = _Builder(graph, rewrite.result)
        magnitudes = (make(aten.abs.default, a), make(aten.abs.default, b))
        lifted = make(aten.clamp.default, make(aten.maximum.default, *magnitudes), 2.0**-14)
        dims = list(range(node_val(lifted).dim()))
        largest = make(aten.amax.default, lifted, dims, True)
        parts = (*magnitudes, lifted.args[0], lifted)
        _, scale = _power_of_two_below(
            make, largest, parts, _ANY_PART_SCALE, exponent_of=_outside_plain_range
        )
        scaled = [make(aten.div.Tensor, part, scale) for part in (a, b)]
        squares = [make(aten.mul.Tensor, part, part) for part in scaled]
        total = make(aten.add.Tensor, *squares)
        root = make(aten.sqrt.default, total)
        for part in (*scaled, *squares, total, root):
            part.meta[SCALED] = "a scaled magnitude's: each part below 128, its square below 16384"
        return make(aten.mul.Tensor, root, scale)


def _outside_plain_range(make: _Builder, exponent: Node) -> Node:
    """The exponent of a magnitude's scale from its largest part's ``e``: ``e`` below 0,
    ``e - 6`` above 6, else 0 (in ops outside XNNPACK's delegate: comparisons, where)."""
    below = make(aten.lt.Scalar, exponent, 0)
    above = make(aten.gt.Scalar, exponent, 6)
    lowered = make(aten.sub.Scalar, exponent, 6)
    plain = make(aten.mul.Scalar, exponent, 0.0)
    return make(aten.where.self, below, exponent, make(aten.where.self, above, lowered, plain))


# Why a magnitude's scale's rounding does not matter: any s > 0 gives the same result.
_ANY_PART_SCALE = (
    "the scale s of a scaled magnitude sqrt(a**2 + b**2): the result is the same for any "
    "s > 0, so its rounding cancels"
)


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


# Why the scaled mean (or sum) of squares cannot flush: a row's largest |y| is at least 64
# (a sum's: 1) unless the row's largest |x| is below 2**-8 (2**-14), and then the eps term
# is eps * 2**28; without an eps, such a row was subnormal in 16-bit before the norm.
_SCALED_POWER = (
    "the mean (or sum) of squares of a scaled norm: at least 4096 / row length (a sum: 1) "
    "where the row's largest magnitude is 2**-8 (a sum: 2**-14) or more, else at least "
    "eps * 2**28; without an eps, a row below that was subnormal in 16-bit before the norm"
)


class LogSoftmax:
    """Before: ``log(softmax(x, dim))`` - probabilities below 6e-8 flush to 0 in fp16,
    and their log to -inf. After: ``log_softmax(x, dim)``, which never forms them.

    Costs: nothing; one fused op replaces two."""

    name = "log_softmax"
    roots = (aten.log.default,)  # the ops a match starts from

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
    """Before: ``log(sigmoid(x))`` - sigmoid of x below -17 is 0 in fp16, its log -inf,
    and below -9.7 it is subnormal, with few bits. After: ``where(x < -8, x -
    log1p(exp(min(x, 0))), log(sigmoid(x)))``, the same function: from -8 up the model's
    own form, bit for bit (two roundings: fewer than any rewritten form there); below, a
    form whose exp cannot overflow and whose log1p keeps the small term, finite and
    accurate however negative x is.

    Costs: a comparison, a select and the rewritten form's clamp, exp, log1p and
    subtraction beside the model's two ops, elementwise in 16-bit; no fp32."""

    name = "log_sigmoid"
    roots = (aten.log.default,)  # the ops a match starts from

    def match(self, node: Node) -> Rewrite | None:
        inner = node.args[0] if _is(node, aten.log.default) else None
        if not (_is(inner, aten.sigmoid.default) and _only_user(inner, node)):
            return None
        if any(_kept_from_minus_8(user, node, inner.args[0]) for user in node.users):
            return None  # the kept form in this rule's own result
        return Rewrite(node, (node, inner))

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        make = _Builder(graph, rewrite.result)
        x = rewrite.result.args[0].args[0]
        tail = make(aten.exp.default, make(aten.clamp.default, x, None, 0.0))
        steep = make(aten.sub.Tensor, x, make(aten.log1p.default, tail))
        probability = make(aten.sigmoid.default, x)
        probability.meta[BOUNDED_BELOW] = _SELECTED_FROM_MINUS_8
        own = make(aten.log.default, probability)
        return make(aten.where.self, make(aten.lt.Scalar, x, -8.0), steep, own)


# Why the kept form's sigmoid cannot flush where its result is used.
_SELECTED_FROM_MINUS_8 = "read only where x >= -8, where sigmoid(x) is at least 3.3e-4"


def _kept_from_minus_8(select: Node, kept: Node, x) -> bool:
    """Whether ``select`` is ``where(x < -8, ..., kept)``: a rewritten log-sigmoid."""
    if not (_is(select, aten.where.self) and select.args[2] is kept):
        return False
    test = select.args[0]
    return _is(test, aten.lt.Scalar) and test.args[0] is x and _scalar(test.args[1], -8.0)


class Log1p:
    """Before: ``log(x + 1)`` - for |x| below 16-bit's epsilon, 1 + x rounds to 1 and
    the result to 0. After: ``log1p(x)``, accurate for small x.

    Costs: nothing; one op replaces two."""

    name = "log1p"
    roots = (aten.log.default,)  # the ops a match starts from

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
    or a multiple of 16-bit's epsilon. After: ``expm1(x)``, accurate for small x.

    Costs: nothing; one op replaces two."""

    name = "expm1"
    roots = (aten.sub.Tensor,)  # the ops a match starts from

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


class TanhGelu:
    """Before: GELU's tanh approximation written out, ``0.5 * x * (1 + tanh(sqrt(2/pi) *
    (x + 0.044715 * x**3)))`` (GPT-2's ``gelu_new``, in any order of its ops) - in
    16-bit each of its eight ops rounds, ``1 + tanh(...)`` cancels for negative x (at x =
    -3 the sum is 0.004, from a tanh rounded to 5e-4), the cube overflows past |x| = 40,
    and its two constants, which fp16 does not hold, stay Python numbers that a runtime
    converts on every call. After: ``gelu(x, approximate="tanh")``, the same formula with
    the same constants, computed whole in the kernel's fp32 arithmetic and rounded once.

    Its constants match where fp32 rounds them to ATen's, as the fp32 program applies
    them: FastGELU's 0.7978845608 and BLOOM's 0.79788456 for sqrt(2/pi) do (``_equal``).
    Costs: nothing; one op replaces eight."""

    name = "tanh_gelu"
    roots = (aten.tanh.default,)  # the ops a match starts from

    def match(self, node: Node) -> Rewrite | None:
        """From the tanh, the formula's result is at most three ops on (``+ 1``, ``* x *
        0.5``), each the only reader of the one before."""
        step = node
        for _ in range(3):
            if len(step.users) != 1:
                return None
            (step,) = step.users
            if not _is(step, *_ARITHMETIC):
                return None
            if _is(step, aten.mul.Tensor):
                found = self._match_at(node, step)
                if found is not None:
                    return found
        return None

    def _match_at(self, tanh: Node, node: Node) -> Rewrite | None:
        outer = read_polynomial(node) if is_float_tensor(node_val(node)) else None
        if outer is None or len(outer.leaves) != 2 or tanh not in outer.leaves:
            return None
        x = next(leaf for leaf in outer.leaves if leaf is not tanh)
        if not _same_tensor_type(x, node):
            return None
        halves = outer.coefficient((x, 1)) == outer.coefficient((x, 1), (tanh, 1)) == 0.5
        inner = read_polynomial(tanh.args[0])
        if not halves or len(outer.terms) != 2 or inner is None or inner.leaves != [x]:
            return None
        if not (
            _equal(inner.coefficient((x, 1)), _GELU_BETA)
            and _equal(inner.coefficient((x, 3)), _GELU_BETA * _GELU_KAPPA)
            and len(inner.terms) == 2
        ):
            return None
        replaced = (*reversed(outer.interior), tanh, *reversed(inner.interior))
        return Rewrite(node, replaced, parts=(x,))

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        (x,) = rewrite.parts
        return _Builder(graph, rewrite.result)(aten.gelu.default, x, approximate="tanh")


_ARITHMETIC = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor)

# ATen's tanh GELU: sqrt(2/pi) * (x + 0.044715 * x**3) inside the tanh
_GELU_BETA = math.sqrt(2 / math.pi)
_GELU_KAPPA = 0.044715


def _equal(found: float, expected: float) -> bool:
    """Equal at the program's precision: within one fp32 step (2**-23 relative) of
    ``expected``. An fp32 op applies its Python scalar rounded to fp32 (ATen's math type
    for fp32 is fp32), so a constant written with fewer digits than ATen's (FastGELU's
    0.7978845608, BLOOM's 0.79788456: 1e-11 and 1e-9 relative) is applied as ATen's own
    or one fp32 step from it, and a coefficient made of two such constants stays within
    that step; a different constant (0.0447 for 0.044715: 4e-4 relative) is not."""
    return abs(found - expected) <= 2**-23 * abs(expected)


def _same_tensor_type(a, b: Node) -> bool:
    """``a`` is a float tensor of ``b``'s dtype and shape."""
    if not isinstance(a, Node) or not is_float_tensor(node_val(a)):
        return False
    first, second = node_val(a), node_val(b)
    return first.dtype == second.dtype and first.shape == second.shape


class TwoPassVariance:
    """Before: ``mean(x**2) - mean(x)**2`` - two large, nearly equal terms: their
    difference cancels to noise (or below 0) when the mean is large against the spread.
    After: ``var(x, dims, correction=0)``, which subtracts the mean first.

    Costs: one more elementwise pass over the values (the subtraction of their mean), in
    16-bit."""

    name = "two_pass_variance"
    roots = (aten.sub.Tensor,)  # the ops a match starts from

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
    states both values.

    Costs: nothing at run time; it changes results where the sum is below the new eps,
    hence opt-in."""

    name = "eps_clamp"
    roots = (aten.rsqrt.default, aten.div.Tensor)  # the ops a match starts from

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
