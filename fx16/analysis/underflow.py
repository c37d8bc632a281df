"""UnderflowAnalysis: values that flush to zero in 16-bit right where an op is singular at zero.

A 16-bit float has a smallest normal value (fp16: 6.1e-5) and a smallest subnormal
(fp16: 6e-8); below the first it loses precision bit by bit, below the second it
is zero. Most ops do not care: a probability of 1e-9 read as 0 moves a sum by
1e-9. An op that is singular at zero does: the log of a softmax's tail, a divisor,
what a reciprocal, ``rsqrt`` or a negative power reads (``fx16.ops.SINGULAR_AT_ZERO``).
Flushed, its result is an infinity, and the entropy term ``p * log(p)`` becomes
``0 * -inf = nan``; subnormal, it is off by up to 100%.

Such an op is kept in fp32, with its argument's elementwise past
(``fx16.analysis.upstream``: the softmax before the log, the mean of squares before
the rsqrt; not the matrix product before them, nor a division's numerator), when
the smallest nonzero magnitude its argument takes lies below the 16-bit smallest
normal times the overflow margin: proven (an interval
that excludes zero), or observed on the calibration inputs. A scalar argument
(``x / 1e-9``) is judged the same way. A scalar an op adds as a guard (``var +
1e-12``) is clamped to the smallest subnormal instead of flushing to zero, as
weights are (InsertFP16CastsPass records that as a decision); when the values
show the guard matters, this rule keeps the op it guards.

Reads: ``meta["fx16.observed_smallest"]`` (CalibrationAnalysis), proven ranges
(``fx16.analysis.float_range``, after ValueRangeAnalysis). Writes:
``node.meta["fx16.underflow"]``: why (a string), on the singular op and every node
of its elementwise past, bodies included; absent elsewhere.
"""

import math

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.float_range import FloatRanges
from fx16.analysis.upstream import elementwise_past
from fx16.contracts import Analysis
from fx16.facts import Facts
from fx16.nodes import node_val
from fx16.numerics import smallest_normal
from fx16.ops import POWER_OPS, SINGULAR_AT_ZERO
from fx16.policy import PrecisionPolicy
from fx16.program import Program


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
        # below this (the margin again) a value is among the 16-bit subnormals, or zero
        self.smallest_normal = smallest_normal((policy or PrecisionPolicy.default()).low)
        self.smallest_normal *= overflow_margin

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
            argument = seed.args[SINGULAR_AT_ZERO[seed.target]]
            reads = [argument] if isinstance(argument, Node) else []
            for node in elementwise_past(seed, boundaries, ranges.of, reads):
                node.meta.setdefault(self.META_KEY, f"feeds {seed.name}, kept in fp32")
        return PassResult(graph_module, False)

    def verdict(self, node: Node, ranges: FloatRanges) -> str | None:
        position = SINGULAR_AT_ZERO.get(node.target) if node.op == "call_function" else None
        val = node_val(node)
        if position is None or position >= len(node.args):
            return None
        if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            return None
        if node.target in POWER_OPS and not (
            isinstance(node.args[1], (int, float)) and node.args[1] < 0
        ):
            return None  # a positive power is not singular at zero
        argument = node.args[position]
        smallest, seen = _smallest_magnitude(argument, ranges)
        if smallest is None or not 0 < smallest < self.smallest_normal:
            return None
        name = argument.name if isinstance(argument, Node) else f"{argument:g}"
        return (
            f"{node.target._opname} is singular at zero, and {name} reaches {smallest:.3g} "
            f"({seen}), below 16-bit's smallest normal value with the margin "
            f"({self.smallest_normal:.3g}): in 16-bit it is subnormal or zero"
        )


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
