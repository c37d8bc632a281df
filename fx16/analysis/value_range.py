"""ValueRangeAnalysis: an interval for every integer value, and where it comes from."""

import enum
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils._sympy.value_ranges import bound_sympy

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.index_bounds import index_bounds
from fx16.contracts import Analysis
from fx16.errors import InvalidOptionError
from fx16.facts import Facts
from fx16.int_ops import INT_DTYPES, POSITION_OPS
from fx16.nodes import named_argument, node_val
from fx16.ops import CAST_OPS, VALUE_PRESERVING_OPS, overloads
from fx16.program import Program
from fx16.subgraphs import bodies_and_operands

aten = torch.ops.aten
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


def _product(a: float, b: float) -> float:
    return 0 if a == 0 or b == 0 else a * b


def multiply(a: ValueRange | None, b: ValueRange | None) -> ValueRange | None:
    if a is None or b is None:
        return None
    corners = [_product(x, y) for x in (a.low, a.high) for y in (b.low, b.high)]
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
        low, high = bounds.lower, bounds.upper
        low = int(low) if low.is_finite else -INF
        high = int(high) if high.is_finite else INF
        return ValueRange(low, high, Source.PROVEN)
    return None


def _checked_ranges(input_ranges) -> dict[str, tuple[int, int]]:
    """``input_ranges`` as given, once each entry is shown to be (low, high) integers."""
    if not isinstance(input_ranges, dict):
        raise InvalidOptionError(
            f"input_ranges must be a dict of name -> (low, high), got {type(input_ranges).__name__}"
        )
    for name, bounds in input_ranges.items():
        if not (
            isinstance(bounds, (tuple, list))
            and len(bounds) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
            and bounds[0] <= bounds[1]
        ):
            raise InvalidOptionError(
                f"input_ranges[{name!r}] must be (low, high) integers with low <= high, "
                f"got {bounds!r}"
            )
    return dict(input_ranges)


class ValueRangeAnalysis(Analysis):
    """Give every integer (and bool) value an interval, with its source.

    Facts come from integer constants and buffers, sizes bounded by the program's
    ``range_constraints``, ``arange``, ops with bounded results (remainder by a
    constant, clamp, comparisons, argmax/argmin/topk/sort indices, bucketize),
    interval arithmetic through add/sub/mul/neg/abs/cumsum/sum, data movement, and
    the user's ``input_ranges={"input_ids": (0, 999)}`` (source: declared). A value
    used as an index into a dimension of size N, or copied or shifted into one, lies
    in [-N, N-1] in every valid call (``fx16.analysis.index_bounds``): proven, where
    nothing tighter is known (a cache position writing a static cache). Where
    none of these gives a range and CalibrationAnalysis saw the value, its observed
    (min, max) is used, marked observed. Bodies of higher-order ops are ranged too
    (``fx16.boundaries``): a body's placeholder has its operands' range, an op's result
    its bodies' outputs'; a value a loop carries has only what calibration saw.

    Reads: the program's signature, state and range constraints, and
    ``meta["fx16.observed_int_range"]`` when calibration ran.
    Writes: ``node.meta["fx16.value_range"]``: a ValueRange, or a tuple of them for
    ops with several outputs; absent where nothing is known.
    """

    META_KEY = meta.PROVEN_RANGE

    def __init__(self, program: Program, input_ranges: dict | None = None) -> None:
        self.program = Program.of(program)
        self.input_ranges = _checked_ranges(input_ranges or {})

    def call(self, graph_module: GraphModule) -> PassResult:
        user_inputs = {node.name: node for node in self.program.user_input_placeholders()}
        unknown = sorted(set(self.input_ranges) - set(user_inputs))
        if unknown:
            raise InvalidOptionError(
                f"input_ranges names {unknown}, which are not user inputs; "
                f"the program's user inputs are {sorted(user_inputs)}"
            )
        declared = {
            user_inputs[name]: ValueRange(low, high, Source.DECLARED)
            for name, (low, high) in self.input_ranges.items()
        }
        state = {slot.placeholder: slot.target for slot in self.program.state_slots()}
        rules = _Rules(self.program.range_constraints())
        boundaries = Facts.of(graph_module).boundaries
        walk = _Walk(self.program, boundaries, declared, state, rules)
        forward = walk.forward(graph_module, {})
        bounds = index_bounds(graph_module.graph, _known(forward), rules.size_bound)
        if bounds:
            confined = {node: ValueRange(*bound, Source.PROVEN) for node, bound in bounds.items()}
            walk = _Walk(self.program, boundaries, declared, state, rules)
            # only what the bounds reach can change (into bodies too: then all of it)
            reached = None if boundaries.looked_into else _downstream(confined)
            walk.forward(graph_module, confined, reached)
        return PassResult(graph_module, False)


class _Walk:
    """One walk in graph order over a graph and, at each higher-order op, its bodies
    (each once): a body's placeholder has the range its operands have (the union over
    the ops that share the body; none for a value a loop carries), an op's result
    the union of its bodies' outputs."""

    def __init__(self, program, boundaries, declared, state, rules) -> None:
        self.program, self.boundaries = program, boundaries
        self.declared, self.state, self.rules = declared, state, rules
        self.walked: set[int] = set()

    def forward(self, graph_module: GraphModule, confined: dict, reached=None) -> dict:
        """Range every node of ``graph_module``; ``confined``: ranges proven by use as an
        index, intersected with what the walk finds; ``reached``: the only nodes whose
        range may differ from the one recorded (None: all). Returns the ranges found
        (of the nodes walked)."""
        found_by_node = {}
        for node in graph_module.graph.nodes:
            if reached is not None and node not in reached:
                continue
            sources = self.boundaries.crossing_sources(node)
            if not sources and _float_op(node) and node not in confined:
                node.meta.pop(ValueRangeAnalysis.META_KEY, None)  # no integer range to find
                continue
            if node.op == "placeholder" and node in self.state:
                found = self.rules.of_state(self.program.state_tensor(self.state[node]))
            elif sources:
                found = union([value_range(source) for source in sources])
            elif node.op == "placeholder":
                found = self.declared.get(node) or self.rules.of_bool(node)
            elif node in self.boundaries.looked_into:
                self.bodies(graph_module, node)
                continue
            elif node.op == "call_function":
                found = _within_dtype(node, self.rules.of(node))
            else:
                continue
            found = _intersect(found, confined.get(node))
            observed = node.meta.get(CalibrationAnalysis.INT_RANGE_KEY)
            if found is None and observed is not None:
                found = ValueRange(*observed, Source.OBSERVED)
            if found is None:
                node.meta.pop(ValueRangeAnalysis.META_KEY, None)
            else:
                found_by_node[node] = found
                node.meta[ValueRangeAnalysis.META_KEY] = found  # later rules read it
        return found_by_node

    def bodies(self, graph_module: GraphModule, node: Node) -> None:
        for body in bodies_and_operands(node)[0]:
            module = getattr(graph_module, body.target)
            if id(module) not in self.walked:
                self.walked.add(id(module))
                self.forward(module, {})


def _float_op(node: Node) -> bool:
    """An op whose value is a float tensor (a higher-order op's is a tuple)."""
    val = node.meta.get("val")
    return node.op == "call_function" and isinstance(val, torch.Tensor) and val.is_floating_point()


def _downstream(nodes) -> set[Node]:
    """``nodes`` and every node that reads them, directly or not, up to float ops (whose
    integer range is none whatever their inputs hold)."""
    reached, pending = set(nodes), list(nodes)
    while pending:
        for user in pending.pop().users:
            if user not in reached and not _float_op(user):
                reached.add(user)
                pending.append(user)
    return reached


def _intersect(found, bound: ValueRange | None):
    if bound is None or isinstance(found, tuple):
        return found
    if found is None:
        return bound
    return ValueRange(max(found.low, bound.low), min(found.high, bound.high), found.source)


def _known(ranges: dict):
    def known(arg) -> tuple[float, float] | None:
        found = ranges.get(arg) if isinstance(arg, Node) else value_range(arg)
        return (found.low, found.high) if isinstance(found, ValueRange) else None

    return known


def _within_dtype(node: Node, found: ValueRange | tuple | None) -> ValueRange | tuple | None:
    """Drop a range the node's own dtype cannot hold: the program wraps there, so the
    true values are unknown (and no narrowing can be justified)."""
    val = node_val(node)
    if isinstance(found, ValueRange) and isinstance(val, torch.Tensor):
        if val.dtype in INT_DTYPES and not found.fits(val.dtype):
            return None
    return found


def value_range(arg: Any) -> ValueRange | None:
    """The range of a node (its recorded single range) or of a Python number."""
    if isinstance(arg, Node):
        found = arg.meta.get(ValueRangeAnalysis.META_KEY)
        return found if isinstance(found, ValueRange) else None
    if isinstance(arg, bool):
        return constant(int(arg))
    if isinstance(arg, int):
        return constant(arg)
    return None


class _Rules:
    """The interval rules, one method per family of ops."""

    def __init__(self, range_constraints: dict) -> None:
        self.range_constraints = range_constraints

    def of_state(self, tensor: torch.Tensor | None) -> ValueRange | None:
        if tensor is None or tensor.dtype not in INT_DTYPES | {torch.bool} or not tensor.numel():
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
            container = node.args[0].meta.get(ValueRangeAnalysis.META_KEY)
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
            min(x.low, _product(length.high, x.low)),
            max(x.high, _product(length.high, x.high)),
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
            min(0, _product(count.high, x.low)), max(0, _product(count.high, x.high)), x, count
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
        (("add.Tensor", "add.Scalar"), _Rules.add),
        (("sub.Tensor", "sub.Scalar"), _Rules.sub),
        (("mul.Tensor", "mul.Scalar"), _Rules.mul),
        (("neg.default",), _Rules.neg),
        (("abs.default",), _Rules.abs),
        (("remainder.Scalar", "remainder.Tensor"), _Rules.remainder),
        (("fmod.Scalar", "fmod.Tensor"), _Rules.fmod),
        (("clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_max.default"), _Rules.clamp),
        (("maximum.default", "minimum.default"), _Rules.extreme),
        (("cumsum.default",), _Rules.running_sum),
        (("sum.default", "sum.dim_IntList"), _Rules.total),
        (("bucketize.Tensor",), _Rules.bucketize),
        (("arange.default", "arange.start", "arange.start_step"), _Rules.arange),
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
            _Rules.filled,
        ),
        (("masked_fill.Scalar", "masked_fill.Tensor"), _Rules.masked_fill),
    ]:
        table.update(dict.fromkeys(overloads(*names), rule))
    return table


_ARITHMETIC = _rule_table()
