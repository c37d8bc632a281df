"""The magnitude rewrite of ``StabilizePass``: sqrt(a**2 + b**2) at one power-of-two scale."""

import torch
from torch.fx import Graph, Node

from fx16.meta import BOUNDED_BELOW, ROUNDING_CANCELS, SCALED
from fx16.passes.stable_rewrites.matching import (
    Builder,
    Rewrite,
    calls,
    only_user,
    power_of_two_below,
    squared,
)
from fx16.program.nodes import node_val

aten = torch.ops.aten


# Why a magnitude's scale's rounding does not matter: any s > 0 gives the same result.
_ANY_PART_SCALE = (
    "the scale s of a scaled magnitude sqrt(a**2 + b**2): the result is the same for any "
    "s > 0, so its rounding cancels"
)


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
    marks = (SCALED, ROUNDING_CANCELS, BOUNDED_BELOW)  # the meta markers its replacement writes

    def match(self, node: Node) -> Rewrite | None:
        if not calls(node, aten.sqrt.default):
            return None
        added = node.args[0]
        if not (calls(added, aten.add.Tensor) and only_user(added, node)):
            return None
        if added.kwargs.get("alpha", 1) != 1 or not all(isinstance(a, Node) for a in added.args):
            return None
        squares = added.args[:2]
        parts = tuple(squared(square) for square in squares)
        if None in parts or squares[0] is squares[1]:
            return None
        if not all(only_user(square, added) for square in squares):
            return None
        return Rewrite(node, (node, added, *squares), parts=parts)

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        a, b = rewrite.parts
        make = Builder(graph, rewrite.result)
        magnitudes = (make(aten.abs.default, a), make(aten.abs.default, b))
        lifted = make(aten.clamp.default, make(aten.maximum.default, *magnitudes), 2.0**-14)
        dims = list(range(node_val(lifted).dim()))
        largest = make(aten.amax.default, lifted, dims, True)
        parts = (*magnitudes, lifted.args[0], lifted)
        _, scale = power_of_two_below(
            make, largest, parts, _ANY_PART_SCALE, exponent_of=_outside_plain_range
        )
        scaled = [make(aten.div.Tensor, part, scale) for part in (a, b)]
        squares = [make(aten.mul.Tensor, part, part) for part in scaled]
        total = make(aten.add.Tensor, *squares)
        root = make(aten.sqrt.default, total)
        for part in (*scaled, *squares, total, root):
            part.meta[SCALED] = "a scaled magnitude's: each part below 128, its square below 16384"
        return make(aten.mul.Tensor, root, scale)


def _outside_plain_range(make: Builder, exponent: Node) -> Node:
    """The exponent of a magnitude's scale from its largest part's ``e``: ``e`` below 0,
    ``e - 6`` above 6, else 0 (in ops outside XNNPACK's delegate: comparisons, where)."""
    below = make(aten.lt.Scalar, exponent, 0)
    above = make(aten.gt.Scalar, exponent, 6)
    lowered = make(aten.sub.Scalar, exponent, 6)
    plain = make(aten.mul.Scalar, exponent, 0.0)
    return make(aten.where.self, below, exponent, make(aten.where.self, above, lowered, plain))
