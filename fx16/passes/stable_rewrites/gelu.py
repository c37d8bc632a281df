"""The tanh-GELU rewrite of ``StabilizePass``: the polynomial form matched, built as
``gelu(x, approximate="tanh")``."""

import math

import torch
from torch.fx import Graph, Node

from fx16.passes.polynomials import read_polynomial
from fx16.passes.stable_rewrites.matching import Builder, Rewrite, calls
from fx16.program.nodes import is_float_tensor, node_val

aten = torch.ops.aten


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
    marks = ()  # the meta markers its replacement writes

    def match(self, node: Node) -> Rewrite | None:
        """From the tanh, the formula's result is at most three ops on (``+ 1``, ``* x *
        0.5``), each the only reader of the one before."""
        step = node
        for _ in range(3):
            if len(step.users) != 1:
                return None
            (step,) = step.users
            if not calls(step, *_ARITHMETIC):
                return None
            if calls(step, aten.mul.Tensor):
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
        return Builder(graph, rewrite.result)(aten.gelu.default, x, approximate="tanh")


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
