"""Proven intervals of float values made from integers, sizes, constants and state.

Positions, timesteps and frequencies are floats computed from integers
(``arange(seq).float()``, ``cache_position.float()``, ``t.float()``), creation ops
and buffers (``inv_freq``). Their range is known before any input is seen: the
integer range analysis bounds the integers (constants, ``range_constraints``,
declared ``input_ranges``, use as an index), and interval arithmetic carries that
through casts, products, sums, exp and data movement. Calibration cannot stand in:
a seq=16 example never shows the angles a seq=2048 call makes.

Ranges are computed on demand (only the values a rule asks about, and their
inputs), each once; a state tensor's range is its min and max. A value holds its
range across the boundaries of higher-order ops (``fx16.program.boundaries``): a body's
placeholder has its operand's, an op's result its bodies' outputs' (a value a loop
carries has none: nothing bounds how it grows).
"""

import math

import torch
from torch.fx import Node

from fx16.analysis.intervals import (
    Source,
    ValueRange,
    add_ranges,
    constant,
    multiply,
    size_range,
    span,
    union,
    value_range,
)
from fx16.ops.tables import CAST_OPS, VALUE_PRESERVING_OPS, overloads, per_op
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from fx16.program.nodes import named_argument, node_val
from fx16.program.tensor_subclasses import is_subclass

aten = torch.ops.aten
_DEPTH = 64  # positions and timesteps are a few ops from their integers

_PRODUCTS = overloads("mul.Tensor", "mul.Scalar")
_QUOTIENTS = overloads("div.Tensor", "div.Scalar")
_SUMS = overloads("add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar")
_MATRIX_PRODUCTS = overloads("mm.default", "bmm.default", "matmul.default")
_NEG_EXP = overloads("neg.default", "exp.default")
_BOUNDED = {
    **dict.fromkeys(overloads("sin.default", "cos.default", "tanh.default"), (-1.0, 1.0)),
    **dict.fromkeys(overloads("sigmoid.default", "rand.default", "rand_like.default"), (0.0, 1.0)),
}
_FILLED = {
    **dict.fromkeys(overloads("zeros.default", "zeros_like.default", "new_zeros.default"), 0.0),
    **dict.fromkeys(overloads("ones.default", "ones_like.default", "new_ones.default"), 1.0),
}
_FILL_VALUE = overloads("full.default", "full_like.default", "new_full.default")
_ARANGE = overloads("arange.default", "arange.start", "arange.start_step")
_MOVES = CAST_OPS | overloads("to.device")  # same values, maybe another dtype or device


class FloatRanges:
    """Proven float intervals, by node, computed when first asked for."""

    def __init__(self, program: Program, boundaries: Boundaries | None = None) -> None:
        self.program = program
        self.boundaries = boundaries or Boundaries(program.graph_module)
        self.state = {slot.placeholder: slot.target for slot in program.state_slots()}
        self.known: dict[Node, ValueRange | None] = {}
        self.depth = 0

    def of(self, arg) -> ValueRange | None:
        """The proven range of a node's value (float or integer) or of a number.

        Each rule asks for its inputs one at a time and gives up at the first unknown
        one, so asking about an activation stops at its producer, and no weight is
        read unless a range needs it. Chains deeper than ``_DEPTH`` count as unknown."""
        if not isinstance(arg, Node):
            if isinstance(arg, (int, float)) and not isinstance(arg, bool):
                return constant(float(arg))
            return None
        if arg not in self.known:
            if self.depth >= _DEPTH:
                return None
            self.depth += 1
            self.known[arg] = None  # a loop's carried value reaches itself: unknown
            try:
                self.known[arg] = self._rule(arg)
            finally:
                self.depth -= 1
        return self.known[arg]

    def _rule(self, node: Node) -> ValueRange | None:
        val = node_val(node)
        if not isinstance(val, torch.Tensor):
            return None
        if not val.is_floating_point():
            return value_range(node)
        sources = self.boundaries.crossing_sources(node)
        if sources:
            return union([self.of(source) for source in sources])
        if node.op == "placeholder":
            return self._state(node)
        if node.op != "call_function":
            return None
        target = node.target
        kind = _kind(target)
        if kind == "bounded":
            return ValueRange(*_BOUNDED[target], Source.PROVEN)
        if kind == "filled":
            return self.of(_FILLED[target])
        if kind == "fill_value":
            return self.of(named_argument(node, "fill_value"))
        if kind == "arange":
            return self._arange(node)
        if kind == "moves":
            return self.of(node.args[0])
        if kind == "preserving":
            return self._union(node)
        return self._arithmetic(node) if kind == "arithmetic" else None

    def state_tensor(self, arg) -> torch.Tensor | None:
        """The state tensor (parameter, buffer, constant) a node stands for, in a body
        too (through the operands fed to its placeholder), or None."""
        if not isinstance(arg, Node):
            return None
        sources = self.boundaries.crossing_sources(arg)
        if arg.op == "placeholder" and len(sources) == 1:
            return self.state_tensor(sources[0])
        return self.program.state_tensor(self.state[arg]) if arg in self.state else None

    def _state(self, node: Node) -> ValueRange | None:
        tensor = self.state_tensor(node)
        if tensor is None or is_subclass(tensor) or not tensor.numel():
            return None
        low, high = (float(bound) for bound in tensor.detach().aminmax())
        return span(low, high)

    def _arange(self, node: Node) -> ValueRange | None:
        ends = [self._bound(named_argument(node, name)) for name in ("start", "end")]
        start = ends[0] if named_argument(node, "start") is not None else self.of(0)
        if start is None or ends[1] is None:
            return None
        return union([start, ends[1]])

    def _bound(self, size) -> ValueRange | None:
        if isinstance(size, torch.SymInt):
            return size_range(size, self.program.range_constraints())
        return self.of(size)

    def _union(self, node: Node) -> ValueRange | None:
        parts = []
        for position in VALUE_PRESERVING_OPS[node.target]:
            arg = node.args[position] if position < len(node.args) else None
            parts.extend(arg if isinstance(arg, (list, tuple)) else [arg])
        ranges = []
        for part in parts:
            ranges.append(self.of(part))
            if ranges[-1] is None:
                return None  # unknown: ask about nothing more
        return union(ranges)

    def _arithmetic(self, node: Node) -> ValueRange | None:
        target = node.target
        a = self.of(node.args[0]) if node.args else None
        if a is None:
            return None
        b = self.of(node.args[1]) if len(node.args) > 1 else None
        if target in _PRODUCTS:
            return multiply(a, b)
        if target in _QUOTIENTS and b is not None and not b.low <= 0 <= b.high:
            return multiply(a, span(1 / b.high, 1 / b.low, b))
        if target in _SUMS:
            alpha = named_argument(node, "alpha")
            scaled = multiply(b, constant(alpha if alpha is not None else 1))
            return add_ranges(a, scaled, -1 if target._opname == "sub" else 1)
        if target == aten.neg.default:
            return multiply(a, constant(-1))
        if target == aten.exp.default:
            return span(_exp(a.low), _exp(a.high), a)
        if target in _MATRIX_PRODUCTS:
            terms = node_val(node.args[0]).shape[-1]  # a sum of this many products
            return multiply(multiply(a, b), constant(terms)) if isinstance(terms, int) else None
        return None


def _exp(x: float) -> float:
    return math.exp(x) if x < 709 else math.inf


@per_op
def _kind(target) -> str:
    """Which rule of ``FloatRanges`` ranges an op's result."""
    tables = (
        ("bounded", _BOUNDED),
        ("filled", _FILLED),
        ("fill_value", _FILL_VALUE),
        ("arange", _ARANGE),
        ("moves", _MOVES),
        ("preserving", VALUE_PRESERVING_OPS),
        ("arithmetic", _PRODUCTS | _QUOTIENTS | _SUMS | _MATRIX_PRODUCTS | _NEG_EXP),
    )
    return next((kind for kind, ops in tables if target in ops), "other")
