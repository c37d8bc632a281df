"""Elementwise arithmetic read as a polynomial, so that a stable rewrite recognises a
formula in whatever order of ops a model wrote it (``0.5 * x * (1 + t)``, ``x * (1 + t) *
0.5``, ``x * k * (1 + c * x * x)``...).

``read_polynomial(node)`` walks back from ``node`` through ``add``, ``sub``, ``mul``,
``neg``, ``div`` by a number and ``pow`` by a small whole number. A value is a leaf
where the walk stops: an op of another kind, or a value something outside the formula
also reads (more than one user: removing the formula must not remove it). The result
maps each monomial - a tuple of (leaf, power), sorted by leaf position - to its
coefficient, computed in Python floats (fp64).
"""

from dataclasses import dataclass, field

import torch
from torch.fx import Node

from fx16.program.nodes import is_number

aten = torch.ops.aten

Monomial = tuple[tuple[int, int], ...]  # (leaf position, power), by position

# A formula with more terms or ops than this is not one a rule matches: give up early
# (a chain of thousands of scale-and-shift steps is read no further than this).
_MOST_TERMS = 8
_MOST_OPS = 16
_LARGEST_POWER = 4


@dataclass
class Polynomial:
    """What ``read_polynomial`` found: ``terms`` over ``leaves``, and the ``interior``
    nodes the formula consists of (each read by the formula alone, ``node`` included)."""

    leaves: list[Node] = field(default_factory=list)
    terms: dict[Monomial, float] = field(default_factory=dict)
    interior: list[Node] = field(default_factory=list)

    def coefficient(self, *powers: tuple[Node, int]) -> float:
        """The coefficient of the monomial ``leaf**power * ...`` (0.0 when absent)."""
        key = tuple(sorted((self.leaves.index(leaf), power) for leaf, power in powers))
        return self.terms.get(key, 0.0)


def read_polynomial(node: Node) -> Polynomial | None:
    """``node``'s value as a polynomial in its leaves (see the module), or None where
    the arithmetic is not polynomial (a division by a tensor) or grows past a formula's
    size (terms, powers, or ops read)."""
    found = Polynomial()
    terms = _Reader(found).read(node, root=True)
    if terms is None:
        return None
    found.terms = {monomial: c for monomial, c in terms.items() if c != 0.0}
    return found


class _Reader:
    def __init__(self, found: Polynomial) -> None:
        self.found = found
        self.memo: dict[Node, dict | None] = {}
        self.ops_read = 0

    def read(self, value, root: bool = False) -> dict[Monomial, float] | None:
        if is_number(value):
            return {(): float(value)}
        if not isinstance(value, Node):
            return None
        if value not in self.memo:
            self.memo[value] = self._read_node(value, root)
        return self.memo[value]

    def _read_node(self, node: Node, root: bool) -> dict[Monomial, float] | None:
        arithmetic = node.op == "call_function" and node.target in _OPS
        if not arithmetic or (not root and len(node.users) != 1):
            return self.leaf(node)
        self.ops_read += 1
        if self.ops_read > _MOST_OPS:
            return None
        terms = _OPS[node.target](self, node)
        if terms is not None:
            self.found.interior.append(node)
        return terms

    def leaf(self, node: Node) -> dict[Monomial, float]:
        if node not in self.found.leaves:
            self.found.leaves.append(node)
        return {((self.found.leaves.index(node), 1),): 1.0}

    def _add(self, node: Node, sign: float) -> dict | None:
        a, b = self.read(node.args[0]), self.read(node.args[1])
        alpha = node.kwargs.get("alpha", 1)
        if a is None or b is None or not is_number(alpha):
            return None
        return _sum(a, _scaled(b, sign * alpha))

    def _mul(self, node: Node) -> dict | None:
        a, b = self.read(node.args[0]), self.read(node.args[1])
        return None if a is None or b is None else _product(a, b)

    def _div(self, node: Node) -> dict | None:
        a, divisor = self.read(node.args[0]), node.args[1]
        if a is None or not is_number(divisor) or divisor == 0 or node.kwargs:
            return None
        return _scaled(a, 1.0 / divisor)

    def _neg(self, node: Node) -> dict | None:
        a = self.read(node.args[0])
        return None if a is None else _scaled(a, -1.0)

    def _pow(self, node: Node) -> dict | None:
        a, power = self.read(node.args[0]), node.args[1]
        whole = is_number(power) and float(power).is_integer() and 1 <= power <= _LARGEST_POWER
        if a is None or not whole:
            return None
        result = a
        for _ in range(int(power) - 1):
            result = _product(result, a)
            if result is None:
                return None
        return result


_OPS = {
    aten.add.Tensor: lambda reader, node: reader._add(node, 1.0),
    aten.sub.Tensor: lambda reader, node: reader._add(node, -1.0),
    aten.mul.Tensor: _Reader._mul,
    aten.div.Tensor: _Reader._div,
    aten.neg.default: _Reader._neg,
    aten.pow.Tensor_Scalar: _Reader._pow,
}


def _scaled(terms: dict, factor: float) -> dict:
    return {monomial: c * factor for monomial, c in terms.items()}


def _sum(a: dict, b: dict) -> dict | None:
    total = dict(a)
    for monomial, c in b.items():
        total[monomial] = total.get(monomial, 0.0) + c
    return total if len(total) <= _MOST_TERMS else None


def _product(a: dict, b: dict) -> dict | None:
    total: dict[Monomial, float] = {}
    for left, c in a.items():
        for right, d in b.items():
            powers = dict(left)
            for leaf, power in right:
                powers[leaf] = powers.get(leaf, 0) + power
            if any(power > _LARGEST_POWER for power in powers.values()):
                return None
            monomial = tuple(sorted(powers.items()))
            total[monomial] = total.get(monomial, 0.0) + c * d
    return total if len(total) <= _MOST_TERMS else None
