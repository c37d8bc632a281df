"""UnderflowAnalysis: values that flush to zero in 16-bit right where an op is singular at zero.

A 16-bit float has a smallest normal value (fp16: 6.1e-5) and a smallest subnormal
(fp16: 6e-8); below the first it loses precision bit by bit, below the second it
is zero. Most ops do not care: a probability of 1e-9 read as 0 moves a sum by
1e-9. An op that is singular at zero does: the log of a softmax's tail, a divisor,
what a reciprocal, ``rsqrt`` or a negative power reads (``fx16.ops.tables.SINGULAR_AT_ZERO``).
Flushed, its result is an infinity, and the entropy term ``p * log(p)`` becomes
``0 * -inf = nan``; subnormal, it is off by up to 100%.

Such an op is kept in fp32, with its argument's elementwise past
(``fx16.analysis.upstream``: the softmax before the log, the mean of squares before
the rsqrt; not the matrix product before them, nor a division's numerator), when its
argument can come near zero on the inputs users send, judged where the argument comes
from (``small_end``):

- a mean or sum of squares, a variance or a norm (a norm's statistic, through sqrt and
  casts): zero on a silent input, whatever calibration showed; it is bounded below
  only by a scalar guard added or clamped to it (``+ eps``, ``clamp_min(eps)``). A
  guard below the 16-bit smallest normal leaves the op singular: kept, unless a
  stable rewrite (``fx16.passes.stabilize``, the default) already scaled the statistic
  into range, which its nodes say (``meta["fx16.bounded_below"]``). What is kept is the
  short chain from the op to the squares, not what the squares read: squaring and
  summing in fp32 is what keeps a quiet input's statistic from flushing;
- an exponential of its input (exp, sigmoid): calibration's smallest value s moves to
  about s ** margin when the input is ``overflow_margin`` times wider (twice the logits
  square a sigmoid's tail), so that is what must stay above the 16-bit smallest
  normal; for a softmax, whose probabilities are ratios of exponentials, (s / l) **
  margin * l, l the largest probability seen (a near-uniform softmax stays one);
- anything else: the smallest nonzero magnitude must stay above the 16-bit smallest
  normal times the margin: proven (an interval that excludes zero), or observed on the
  calibration inputs.

A scalar argument (``x / 1e-9``) is judged the same way. A scalar an op adds as a guard
(``var + 1e-12``) is clamped to the smallest subnormal instead of flushing to zero, as
weights are (InsertFP16CastsPass records that as a decision); when the values show the
guard matters, this rule keeps the op it guards.

An argument a scale domain carried lower on its way (``x * y`` at 2**-25, unscaled by a
runtime multiply before the rsqrt) is judged at that lowest exponent: there its small
elements were subnormal, whatever the unscaled value shows.

Reads: ``meta["fx16.observed_smallest"]`` (CalibrationAnalysis), proven ranges
(``fx16.analysis.float_range``, after ValueRangeAnalysis), ``meta["fx16.bounded_below"]``
(StabilizePass), ``meta["fx16.scale_exponent"]`` and ``meta["fx16.range_scale"]``
(ScaleDomainsPass). Writes:
``node.meta["fx16.underflow"]``: why (a string), on the singular op and every node
of its elementwise past, bodies included; absent elsewhere.
"""

import math
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.facts import Facts
from fx16.analysis.float_range import FloatRanges
from fx16.analysis.upstream import elementwise_past
from fx16.contracts import Analysis
from fx16.ops.numeric_tables import (
    EXPONENTIAL_TAIL_OPS,
    GUARD_OPS,
    POWER_OPS,
    SINGULAR_AT_ZERO,
    SMALL_END_PRESERVING_OPS,
    SOFTMAX_OPS,
    SQUARE_STATISTIC_OPS,
    SUMMING_OPS,
)
from fx16.ops.numerics import smallest_normal
from fx16.ops.tables import overloads
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.program.nodes import node_val

ADDS = overloads("add.Tensor")
MULTIPLIES = overloads("mul.Tensor")


class UnderflowAnalysis(Analysis):
    """Mark the ops singular at zero whose argument would flush to zero or lose its
    precision among 16-bit's subnormals, with their elementwise past (see the module)."""

    META_KEY = meta.UNDERFLOW

    def __init__(
        self,
        program: Program,
        policy: PrecisionPolicy | None = None,
        overflow_margin: float = 2.0,
    ) -> None:
        self.program = Program.of(program)
        self.normal = smallest_normal((policy or PrecisionPolicy.default()).low)
        self.margin = overflow_margin
        # below this (the margin again) a value is among the 16-bit subnormals, or zero
        self.smallest_normal = self.normal * overflow_margin

    def call(self, graph_module: GraphModule) -> PassResult:
        boundaries = Facts.of(graph_module).boundaries
        ranges = Facts.of(graph_module).float_ranges(self.program)
        seeds = []
        for module in boundaries.graph_modules:
            for node in module.graph.nodes:
                node.meta.pop(self.META_KEY, None)
                why = self.verdict(node, ranges)
                if why is not None:
                    node.meta[self.META_KEY] = why
                    seeds.append(node)
        for seed in seeds:
            argument = singular_argument(seed)
            reads = [argument] if isinstance(argument, Node) else []
            end = small_end(argument)
            if end.kind == "statistic":  # its squares and sum in fp32 are what matters
                chain = list(end.path)
            else:
                chain = elementwise_past(seed, boundaries, ranges.of, reads)
            for node in chain:
                node.meta.setdefault(self.META_KEY, f"feeds {seed.name}, kept in fp32")
        return PassResult(graph_module, False)

    def verdict(self, node: Node, ranges: FloatRanges) -> str | None:
        argument = singular_argument(node)
        val = node_val(node)
        if argument is None or not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            return None
        singular = f"{node.target._opname} is singular at zero, and"
        end = small_end(argument)
        if end.kind == "bounded":
            return None
        if end.kind == "statistic" and end.guard < self.normal:
            return (
                f"{singular} {argument.name} is {end.what} ({end.source.name}), zero on a silent "
                f"input whatever calibration saw, guarded only by {end.guard:.3g}, below 16-bit's "
                f"smallest normal value ({self.normal:.3g}): in 16-bit a quiet input's squares "
                "flush to zero"
            )
        smallest, seen = _smallest_magnitude(argument, ranges)
        if smallest is None or smallest <= 0:
            return None
        name = argument.name if isinstance(argument, Node) else f"{argument:g}"
        if end.kind in ("exponential", "softmax") and seen == "observed" and smallest < 1:
            widened = self.widened(end, argument, smallest)
            if widened < self.normal:
                return (
                    f"{singular} {name} is {end.what} ({end.source.name}): it reaches "
                    f"{smallest:.3g} (observed), and {widened:.3g} at {self.margin:g}x its input "
                    f"(the overflow margin), below 16-bit's smallest normal value "
                    f"({self.normal:.3g}): in 16-bit it is subnormal or zero"
                )
            return None
        shift = end.exponent - meta.scale_exponent(argument)
        carried = smallest * 2.0**shift if shift < 0 else smallest
        if carried >= self.smallest_normal:
            return None
        how = f", {carried:.3g} where a scale domain carried it at 2**{shift}" if shift < 0 else ""
        return (
            f"{singular} {name} reaches {smallest:.3g} ({seen}){how}, below 16-bit's smallest "
            f"normal value with the margin ({self.smallest_normal:.3g}): in 16-bit it is "
            "subnormal or zero"
        )

    def widened(self, end: "SmallEnd", argument: Node, smallest: float) -> float:
        """An exponential's smallest value when its input is ``margin`` times wider."""
        if end.kind == "exponential":
            return smallest**self.margin
        largest = min(meta.observed_max_abs(argument) or 1.0, 1.0)
        return (smallest / largest) ** self.margin * largest


def singular_argument(node: Node):
    """The argument (a node or a number) ``node`` is singular at where it is zero (a
    log's argument, a divisor, a negative power's base), or None for another op."""
    position = SINGULAR_AT_ZERO.get(node.target) if node.op == "call_function" else None
    if position is None or position >= len(node.args):
        return None
    if node.target in POWER_OPS and not (
        isinstance(node.args[1], (int, float)) and node.args[1] < 0
    ):
        return None  # a positive power is not singular at zero
    return node.args[position]


@dataclass(frozen=True)
class SmallEnd:
    """Where a value's smallest magnitude comes from: ``kind`` "statistic" (a mean or sum
    of squares, a variance, a norm), "exponential" (exp, sigmoid), "softmax", "bounded"
    (a stable rewrite's statistic, scaled into range) or "other"; ``source`` the op that
    sets it; ``guard`` the largest scalar added or clamped to on the way (0: none)."""

    kind: str
    source: Node | None = None
    guard: float = 0.0
    path: tuple[Node, ...] = ()  # the nodes from the value to the source, and its squares
    exponent: int = 0  # the lowest scale exponent on the way (the value's own, or a lower one)

    @property
    def what(self) -> str:
        if self.kind == "statistic":
            return "a mean or sum of squares"
        return "an exponential of its input"


def small_end(argument) -> SmallEnd:
    """Walk from ``argument`` through casts, moves, sqrt, scalar guards and a scale
    domain's multiplies to the op that sets its small end (see ``SmallEnd``)."""
    guard, node, path = 0.0, argument, []
    lowest = meta.scale_exponent(argument) if isinstance(argument, Node) else 0
    while isinstance(node, Node) and node.op == "call_function":
        path.append(node)
        lowest = min(lowest, meta.scale_exponent(node))
        if meta.bounded_below(node):
            return SmallEnd("bounded", node, guard)
        target = node.target
        if meta.range_scaled(node) or target in SMALL_END_PRESERVING_OPS:
            node = node.args[0]
        elif target in GUARD_OPS and _guard(node) is not None:
            guard = max(guard, _guard(node))
            node = node.args[0]
        elif target in EXPONENTIAL_TAIL_OPS:
            return SmallEnd("exponential", node, guard)
        elif target in SOFTMAX_OPS:
            return SmallEnd("softmax", node, guard)
        elif target in SQUARE_STATISTIC_OPS:
            return SmallEnd("statistic", node, guard, tuple(path))
        elif target in SUMMING_OPS and _squares(node.args[0]):
            return SmallEnd("statistic", node, guard, (*path, node.args[0]))
        else:
            break
    return SmallEnd("other", node if isinstance(node, Node) else None, guard, (), lowest)


def _guard(node: Node) -> float | None:
    """The scalar ``node`` adds (``x + eps``) or raises its input to
    (``clamp_min(x, eps)``, ``clamp(x, eps, ...)``), or None; 0 where it adds nothing
    (``x + 0`` leaves the small end where it was), None for a negative one."""
    if node.target in ADDS:
        scalar = node.args[1] if node.kwargs.get("alpha", 1) == 1 else None
    else:  # clamp_min(x, min), clamp(x, min, max)
        scalar = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    is_scalar = isinstance(scalar, (int, float)) and not isinstance(scalar, bool)
    return float(scalar) if is_scalar and scalar >= 0 else None


def _squares(node) -> bool:
    """Whether ``node`` is ``x ** 2`` or ``x * x``."""
    if not (isinstance(node, Node) and node.op == "call_function"):
        return False
    if node.target in POWER_OPS:
        return node.args[1] == 2
    return node.target in MULTIPLIES and node.args[0] is node.args[1]


def _smallest_magnitude(argument, ranges: FloatRanges) -> tuple[float | None, str]:
    """The smallest nonzero |value| of ``argument``: a scalar's own, proven from an
    interval that excludes zero, else observed."""
    if isinstance(argument, (int, float)) and not isinstance(argument, bool):
        return abs(float(argument)), "a scalar"
    if not isinstance(argument, Node):
        return None, ""
    proven = ranges.of(argument)
    if proven is not None and (proven.low > 0 or proven.high < 0):
        smallest = min(abs(proven.low), abs(proven.high))
        if math.isfinite(smallest):
            return smallest, "proven"
    return argument.meta.get(CalibrationAnalysis.SMALLEST_KEY), "observed"
