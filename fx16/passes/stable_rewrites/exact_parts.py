"""Error-free transformations built as graph nodes, for a rewrite that computes a value
to about twice the 16-bit type's precision: a number split into two halves whose
products are exact, the exact error of a product, the exact error of a sum.

Each holds in any binary floating-point type of p bits (fp16: p = 11) while no value
overflows or falls below the normal range (then the error is approximate, at the
subnormal step). Every node made is marked with the caller's reasons: its rounding is
recovered by the nodes after it (``meta["fx16.rounding_cancels"]``), and a part that
flushes is one far below the value it corrects (``meta["fx16.negligible"]``).
"""

import torch
from torch.fx import Node

from fx16.meta import NEGLIGIBLE, ROUNDING_CANCELS
from fx16.passes.stable_rewrites.matching import Builder

aten = torch.ops.aten

# Veltkamp's constant for p = 11: 2**6 + 1 leaves a high half of 5 bits and a low half of
# at most 5, so the product of any two halves has at most 10 bits and is exact.
_SPLITTER = 2.0**6 + 1


class ExactParts:
    """Makes error-free transformations with ``make``, marking every node it makes as
    ``why`` says (rounding recovered, flushing negligible)."""

    def __init__(self, make: Builder, why: str) -> None:
        self.make, self.why = make, why

    def __call__(self, target, *args, **kwargs) -> Node:
        node = self.make(target, *args, **kwargs)
        node.meta[ROUNDING_CANCELS] = self.why
        node.meta[NEGLIGIBLE] = self.why
        return node

    def split(self, value: Node) -> tuple[Node, Node]:
        """(high, low) with ``high + low == value`` exactly, each of at most 5 bits
        (Veltkamp): ``65 * value`` must stay below the largest finite value."""
        spread = self(aten.mul.Tensor, value, _SPLITTER)
        high = self(aten.sub.Tensor, spread, self(aten.sub.Tensor, spread, value))
        return high, self(aten.sub.Tensor, value, high)

    def product_error(self, a: tuple[Node, Node], b: tuple[Node, Node], product: Node) -> Node:
        """``a * b - product`` exactly, for ``product`` the rounded ``a * b`` and ``a``, ``b``
        as their halves (Dekker)."""
        (a_high, a_low), (b_high, b_low) = a, b
        error = self(aten.sub.Tensor, self(aten.mul.Tensor, a_high, b_high), product)
        for left, right in ((a_high, b_low), (a_low, b_high), (a_low, b_low)):
            error = self(aten.add.Tensor, error, self(aten.mul.Tensor, left, right))
        return error

    def sum_error(self, a: Node, b: Node, total: Node) -> Node:
        """``a + b - total`` exactly, for ``total`` the rounded ``a + b`` (Knuth)."""
        b_part = self(aten.sub.Tensor, total, a)
        a_part = self(aten.sub.Tensor, total, b_part)
        return self(
            aten.add.Tensor,
            self(aten.sub.Tensor, a, a_part),
            self(aten.sub.Tensor, b, b_part),
        )
