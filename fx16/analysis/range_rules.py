"""The interval rules of ``ValueRangeAnalysis``: one method per family of integer ops."""

import math
import operator
from typing import Any

import torch
from torch.fx import Node

from fx16 import meta
from fx16.analysis.intervals import (
    INF,
    Source,
    ValueRange,
    add_ranges,
    constant,
    multiply,
    product,
    size_range,
    span,
    union,
    value_range,
)
from fx16.ops.int_ops import INT_DTYPES, POSITION_OPS
from fx16.ops.tables import CAST_OPS, VALUE_PRESERVING_OPS, overloads
from fx16.program.nodes import named_argument, node_val

aten = torch.ops.aten


# State dtypes whose range is read off the tensor (a float's is not an integer range).
_RANGED_STATE = INT_DTYPES | {torch.bool}


class RangeRules:
    """The interval rules, one method per family of ops."""

    def __init__(self, range_constraints: dict) -> None:
        self.range_constraints = range_constraints

    def of_state(self, tensor: torch.Tensor | None) -> ValueRange | None:
        if tensor is None or tensor.dtype not in _RANGED_STATE or not tensor.numel():
            return None
        return ValueRange(int(tensor.min()), int(tensor.max()), Source.PROVEN)

    def of_bool(self, node: Node) -> ValueRange | None:
        val = node_val(node)
        is_bool = isinstance(val, torch.Tensor) and val.dtype == torch.bool
        return ValueRange(0, 1, Source.PROVEN) if is_bool else None

    def of_arg(self, arg: Any) -> ValueRange | None:
        """Range of an argument: a node's recorded range, or an int/SymInt's bounds."""
        return value_range(arg) if isinstance(arg, Node) else self.of_size(arg)

    def size_bound(self, size: Any) -> float | None:
        """The largest value a size can take, if finite."""
        found = self.of_size(size)
        return found.high if found is not None and math.isfinite(found.high) else None

    def of_size(self, size: Any) -> ValueRange | None:
        return size_range(size, self.range_constraints)

    def of(self, node: Node) -> ValueRange | tuple | None:
        val = node_val(node)
        if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            return None  # the ranges here are of integers and bools
        if isinstance(val, torch.SymInt):
            return self.of_size(val)
        if node.target is operator.getitem:
            container = node.args[0].meta.get(meta.PROVEN_RANGE)
            return container[node.args[1]] if isinstance(container, tuple) else container
        if node.target in POSITION_OPS:
            return self.positions(node)
        boolean = self.of_bool(node)
        if boolean is not None:
            return boolean
        if isinstance(val, (list, tuple)):
            preserved = self.preserved(node)
            return tuple(preserved for _ in val) if preserved is not None else None
        if not isinstance(val, torch.Tensor) or val.dtype not in INT_DTYPES:
            return None
        rule = _ARITHMETIC.get(node.target)
        if rule is not None:
            return rule(self, node)
        if node.target in VALUE_PRESERVING_OPS:
            return self.preserved(node)
        if node.target in CAST_OPS:
            source = value_range(node.args[0])
            return source if source is not None and source.fits(val.dtype) else None
        return None

    def preserved(self, node: Node) -> ValueRange | None:
        parts = []
        for position in VALUE_PRESERVING_OPS.get(node.target, ()):
            arg = node.args[position] if position < len(node.args) else None
            parts.extend(arg if isinstance(arg, (list, tuple)) else [arg])
        return union([value_range(part) for part in parts])

    def positions(self, node: Node) -> ValueRange | tuple | None:
        source_val = node_val(node.args[0])
        dim = named_argument(node, "dim")
        extent = source_val.numel() if dim is None else source_val.shape[dim]
        size = self.of_size(extent)
        indices = None if size is None else span(0, max(size.high - 1, 0), size)
        output = POSITION_OPS[node.target]
        if output is None:
            return indices
        values = value_range(node.args[0])
        return (values, indices)

    # ---- arithmetic and bounded ops ----------------------------------------------

    def add(self, node: Node, sign: int = 1) -> ValueRange | None:
        alpha = named_argument(node, "alpha")
        scaled = multiply(value_range(node.args[1]), constant(alpha if alpha is not None else 1))
        return add_ranges(value_range(node.args[0]), scaled, sign)

    def sub(self, node: Node) -> ValueRange | None:
        return self.add(node, -1)

    def mul(self, node: Node) -> ValueRange | None:
        return multiply(value_range(node.args[0]), value_range(node.args[1]))

    def neg(self, node: Node) -> ValueRange | None:
        return multiply(value_range(node.args[0]), constant(-1))

    def abs(self, node: Node) -> ValueRange | None:
        x = value_range(node.args[0])
        if x is None:
            return None
        low = 0 if x.low <= 0 <= x.high else min(abs(x.low), abs(x.high))
        return span(low, max(abs(x.low), abs(x.high)), x)

    def remainder(self, node: Node) -> ValueRange | None:
        """Python-style remainder takes the divisor's sign: x % 97 lies in [0, 96]."""
        divisor = value_range(node.args[1])
        if divisor is None or divisor.low <= 0 <= divisor.high:
            return None
        if divisor.low > 0:
            return span(0, divisor.high - 1, divisor)
        return span(divisor.low + 1, 0, divisor)

    def fmod(self, node: Node) -> ValueRange | None:
        x, divisor = value_range(node.args[0]), value_range(node.args[1])
        if divisor is None or x is None or divisor.low <= 0 <= divisor.high:
            return None
        largest = max(abs(divisor.low), abs(divisor.high)) - 1
        return span(-largest if x.low < 0 else 0, largest if x.high > 0 else 0, x, divisor)

    def clamp(self, node: Node) -> ValueRange | None:
        low, high = named_argument(node, "min"), named_argument(node, "max")
        x = value_range(node.args[0]) or ValueRange(-INF, INF, Source.PROVEN)
        low_range = value_range(low) if low is not None else ValueRange(-INF, -INF, Source.PROVEN)
        high_range = value_range(high) if high is not None else ValueRange(INF, INF, Source.PROVEN)
        if low_range is None or high_range is None:
            return None
        # clamp(x, lo, hi) is min(max(x, lo), hi), applied to both ends of x
        result_low = min(max(x.low, low_range.low), high_range.high)
        result_high = min(max(x.high, low_range.low), high_range.high)
        if not (math.isfinite(result_low) and math.isfinite(result_high)):
            return None
        return span(result_low, result_high, x, low_range, high_range)

    def extreme(self, node: Node) -> ValueRange | None:
        """maximum/minimum: both bounds are a max (or a min) of the operands' bounds."""
        a, b = value_range(node.args[0]), value_range(node.args[1])
        pick = max if node.target == aten.maximum.default else min
        if a is None or b is None:
            return None
        return span(pick(a.low, b.low), pick(a.high, b.high), a, b)

    def running_sum(self, node: Node) -> ValueRange | None:
        """cumsum along a dim of length L: each partial sum is in [min(lo, L*lo), max(hi, L*hi)]."""
        x = value_range(node.args[0])
        length = self.of_size(node_val(node.args[0]).shape[node.args[1]])
        if x is None or length is None:
            return None
        return span(
            min(x.low, product(length.high, x.low)),
            max(x.high, product(length.high, x.high)),
            x,
            length,
        )

    def total(self, node: Node) -> ValueRange | None:
        """sum: N terms, N counted generously (every element) to stay an upper bound."""
        x = value_range(node.args[0])
        count = self.of_size(node_val(node.args[0]).numel())
        if x is None or count is None:
            return None
        return span(
            min(0, product(count.high, x.low)), max(0, product(count.high, x.high)), x, count
        )

    def bucketize(self, node: Node) -> ValueRange | None:
        boundaries = node_val(node.args[1])
        size = self.of_size(boundaries.shape[-1]) if isinstance(boundaries, torch.Tensor) else None
        return None if size is None else span(0, size.high, size)

    def arange(self, node: Node) -> ValueRange | None:
        """arange(start=0, end, step=1) with step > 0: [start, end - 1]."""
        start, end, step = (
            self.of_arg(named_argument(node, name))
            if named_argument(node, name) is not None
            else constant(default)
            for name, default in (("start", 0), ("end", None), ("step", 1))
        )
        if start is None or end is None or step is None or step.low <= 0:
            return None
        return span(start.low, max(end.high - 1, start.low), start, end, step)

    def filled(self, node: Node) -> ValueRange | None:
        value = {
            aten.zeros.default: 0,
            aten.zeros_like.default: 0,
            aten.ones.default: 1,
            aten.ones_like.default: 1,
            aten.new_zeros.default: 0,
            aten.new_ones.default: 1,
        }
        if node.target in value:
            return constant(value[node.target])
        fill = named_argument(node, "fill_value")
        if fill is None:
            fill = named_argument(node, "s")
        return value_range(fill)

    def masked_fill(self, node: Node) -> ValueRange | None:
        return union([value_range(node.args[0]), value_range(node.args[2])])


def _rule_table() -> dict:
    table = {}
    for names, rule in [
        (("add.Tensor", "add.Scalar"), RangeRules.add),
        (("sub.Tensor", "sub.Scalar"), RangeRules.sub),
        (("mul.Tensor", "mul.Scalar"), RangeRules.mul),
        (("neg.default",), RangeRules.neg),
        (("abs.default",), RangeRules.abs),
        (("remainder.Scalar", "remainder.Tensor"), RangeRules.remainder),
        (("fmod.Scalar", "fmod.Tensor"), RangeRules.fmod),
        (
            ("clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_max.default"),
            RangeRules.clamp,
        ),
        (("maximum.default", "minimum.default"), RangeRules.extreme),
        (("cumsum.default",), RangeRules.running_sum),
        (("sum.default", "sum.dim_IntList"), RangeRules.total),
        (("bucketize.Tensor",), RangeRules.bucketize),
        (("arange.default", "arange.start", "arange.start_step"), RangeRules.arange),
        (
            (
                "zeros.default",
                "zeros_like.default",
                "ones.default",
                "ones_like.default",
                "new_zeros.default",
                "new_ones.default",
                "full.default",
                "full_like.default",
                "new_full.default",
                "scalar_tensor.default",
            ),
            RangeRules.filled,
        ),
        (("masked_fill.Scalar", "masked_fill.Tensor"), RangeRules.masked_fill),
    ]:
        table.update(dict.fromkeys(overloads(*names), rule))
    return table


_ARITHMETIC = _rule_table()
