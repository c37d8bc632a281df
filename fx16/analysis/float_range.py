"""Proven intervals of float values made from integers, sizes, constants and state.

Positions, timesteps and frequencies are floats computed from integers
(``arange(seq).float()``, ``cache_position.float()``, ``t.float()``), creation ops
and buffers (``inv_freq``). Their range is known before any input is seen: the
integer range analysis bounds the integers (constants, ``range_constraints``,
declared ``input_ranges``, use as an index), and interval arithmetic carries that
through casts, products, sums, exp and data movement. Calibration cannot stand in:
a seq=16 example never shows the angles a seq=2048 call makes.

Ranges are computed on demand (only the values a rule asks about, and their
inputs), each once; a state tensor's range is its min and max.
"""

import math

import torch
from torch.fx import Node

from fx16.analysis.value_range import Source, ValueRange, value_range
from fx16.nodes import named_argument, node_val
from fx16.ops import CAST_OPS, VALUE_PRESERVING_OPS, overloads
from fx16.program import Program
from fx16.tensor_subclasses import is_subclass

aten = torch.ops.aten
INF = math.inf
_DEPTH = 64  # positions and timesteps are a few ops from their integers

_PRODUCTS = overloads("mul.Tensor", "mul.Scalar")
_QUOTIENTS = overloads("div.Tensor", "div.Scalar")
_SUMS = overloads("add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar")
_MATRIX_PRODUCTS = overloads("mm.default", "bmm.default", "matmul.default")
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
_DEVICE_MOVES = overloads("to.device", "to.dtype_layout", "_to_copy.default", "to.dtype")


def _interval(low: float, high: float, *parts: ValueRange | None) -> ValueRange | None:
    if any(part is None for part in parts) or math.isnan(low) or math.isnan(high):
        return None
    source = max((part.source for part in parts), default=Source.PROVEN)
    return ValueRange(low, high, source)


def _corners(a: ValueRange, b: ValueRange, combine) -> tuple[float, float]:
    values = [combine(x, y) for x in (a.low, a.high) for y in (b.low, b.high)]
    values = [0.0 if math.isnan(v) else v for v in values]  # 0 * inf: the zero end
    return min(values), max(values)


def _product(x: float, y: float) -> float:
    return 0.0 if x == 0 or y == 0 else x * y


class FloatRanges:
    """Proven float intervals, by node, computed when first asked for."""

    def __init__(self, program: Program) -> None:
        self.program = program
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
                return ValueRange(float(arg), float(arg), Source.PROVEN)
            return None
        if arg not in self.known:
            if self.depth >= _DEPTH:
                return None
            self.depth += 1
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
        if node.op == "placeholder":
            return self._state(node)
        if node.op != "call_function":
            return None
        target = node.target
        if target in _BOUNDED:
            return ValueRange(*_BOUNDED[target], Source.PROVEN)
        if target in _FILLED:
            return self.of(_FILLED[target])
        if target in _FILL_VALUE:
            return self.of(named_argument(node, "fill_value"))
        if target in _ARANGE:
            return self._arange(node)
        if target in CAST_OPS or target in _DEVICE_MOVES:
            return self.of(node.args[0])
        if target in VALUE_PRESERVING_OPS:
            return self._union(node)
        return self._arithmetic(node)

    def _state(self, node: Node) -> ValueRange | None:
        tensor = self.program.state_tensor(self.state[node]) if node in self.state else None
        if tensor is None or is_subclass(tensor) or not tensor.numel():
            return None
        low, high = (float(bound) for bound in tensor.detach().aminmax())
        return _interval(low, high)

    def _arange(self, node: Node) -> ValueRange | None:
        ends = [self._bound(named_argument(node, name)) for name in ("start", "end")]
        start = ends[0] if named_argument(node, "start") is not None else self.of(0)
        if start is None or ends[1] is None:
            return None
        return _interval(min(start.low, ends[1].low), max(start.high, ends[1].high), start, ends[1])

    def _bound(self, size) -> ValueRange | None:
        if isinstance(size, torch.SymInt):
            from fx16.analysis.value_range import _Rules  # the int analysis' size rule

            return _Rules(self.program.range_constraints()).of_size(size)
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
                return None
        if not ranges:
            return None
        return _interval(min(r.low for r in ranges), max(r.high for r in ranges), *ranges)

    def _arithmetic(self, node: Node) -> ValueRange | None:
        target = node.target
        a = self.of(node.args[0]) if node.args else None
        if a is None:
            return None
        b = self.of(node.args[1]) if len(node.args) > 1 else None
        if target in _PRODUCTS and a and b:
            return _interval(*_corners(a, b, _product), a, b)
        if target in _QUOTIENTS and a and b and not b.low <= 0 <= b.high:
            return _interval(*_corners(a, b, lambda x, y: x / y), a, b)
        if target in _SUMS and a and b:
            alpha = named_argument(node, "alpha")
            sign = (-1 if target._opname == "sub" else 1) * (alpha if alpha is not None else 1)
            scaled = _interval(*sorted((sign * b.low, sign * b.high)), b)
            return _interval(a.low + scaled.low, a.high + scaled.high, a, scaled)
        if target == aten.neg.default and a:
            return _interval(-a.high, -a.low, a)
        if target == aten.exp.default and a:
            return _interval(_exp(a.low), _exp(a.high), a)
        if target in _MATRIX_PRODUCTS and a and b:
            terms = node_val(node.args[0]).shape[-1]
            if not isinstance(terms, int):
                return None
            low, high = _corners(a, b, _product)
            return _interval(min(low, terms * low), max(high, terms * high), a, b)
        return None


def _exp(x: float) -> float:
    return math.exp(x) if x < 709 else INF
