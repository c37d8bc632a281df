"""Integer intervals with where they come from, and their arithmetic (for the range
analyses: ``fx16.analysis.value_range``, ``fx16.analysis.float_range``)."""

import enum
import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.fx import Node
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.value_ranges import bound_sympy

from fx16 import meta

INF = math.inf


class Source(enum.IntEnum):
    """How a range is known; a combination is only as strong as its weakest part."""

    PROVEN = 0  # constants, shapes bounded by range_constraints, op semantics
    DECLARED = 1  # the user's input_ranges
    OBSERVED = 2  # seen on calibration inputs, not proven


@dataclass(frozen=True)
class ValueRange:
    low: float  # an int, or -inf
    high: float  # an int, or inf
    source: Source

    def fits(self, dtype: torch.dtype) -> bool:
        info = torch.iinfo(dtype)
        return info.min <= self.low and self.high <= info.max

    def __str__(self) -> str:
        return f"[{_show(self.low)}, {_show(self.high)}] ({self.source.name.lower()})"


def _show(bound: float) -> str:
    return str(int(bound)) if math.isfinite(bound) else ("-inf" if bound < 0 else "inf")


def span(low, high, *parts: ValueRange | None) -> ValueRange | None:
    """A range built from ``parts``: None if any is unknown (or a bound is nan, as
    inf - inf gives), else their weakest source."""
    if any(part is None for part in parts) or math.isnan(low) or math.isnan(high):
        return None
    source = max((part.source for part in parts), default=Source.PROVEN)
    return ValueRange(low, high, source)


def union(parts: list[ValueRange | None]) -> ValueRange | None:
    if not parts or any(part is None for part in parts):
        return None
    return span(min(p.low for p in parts), max(p.high for p in parts), *parts)


def product(a: float, b: float) -> float:
    return 0 if a == 0 or b == 0 else a * b


def multiply(a: ValueRange | None, b: ValueRange | None) -> ValueRange | None:
    if a is None or b is None:
        return None
    corners = [product(x, y) for x in (a.low, a.high) for y in (b.low, b.high)]
    return span(min(corners), max(corners), a, b)


def add_ranges(a: ValueRange | None, b: ValueRange | None, sign: int = 1) -> ValueRange | None:
    if a is None or b is None:
        return None
    low, high = (b.low, b.high) if sign > 0 else (-b.high, -b.low)
    return span(a.low + low, a.high + high, a, b)


def constant(value: float) -> ValueRange:
    return ValueRange(value, value, Source.PROVEN)


def size_range(size: Any, range_constraints: dict) -> ValueRange | None:
    """Range of an int or SymInt size, bounded by the program's range constraints."""
    if isinstance(size, int):
        return constant(size)
    if isinstance(size, torch.SymInt):
        bounds = bound_sympy(size.node.expr, range_constraints)
        return ValueRange(_bound(bounds.lower), _bound(bounds.upper), Source.PROVEN)
    return None


def _bound(bound) -> float:
    """A sympy bound as a number: an int, or +-inf (sympy's oo and torch's int_oo, which
    calls itself finite)."""
    if bound in (int_oo, sympy.oo):
        return INF
    if bound in (-int_oo, -sympy.oo):
        return -INF
    return int(bound)


def value_range(arg: Any) -> ValueRange | None:
    """The range of a node (its recorded single range) or of a Python number."""
    if isinstance(arg, Node):
        found = arg.meta.get(meta.PROVEN_RANGE)
        return found if isinstance(found, ValueRange) else None
    if isinstance(arg, bool):
        return constant(int(arg))
    if isinstance(arg, int):
        return constant(arg)
    return None
