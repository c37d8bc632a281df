"""SentinelFillsPass: a mask's fill far beyond the values it replaces is a sentinel.

``scores.masked_fill(~mask, -1e9)`` (or ``torch.where(mask, scores, -1e9)``,
``torch.full(shape, -1e9)`` added to scores) stands for minus infinity: a softmax gives
its elements weight 0 whatever the fill, as long as the fill lies far below the scores.
Past fp16's range, -1e9 itself would keep the fill and its readers fp32 (an overflowing
scalar), or start a scale domain of 2**-15 that pushes the scores' weights below range.
fx16 already carries ``finfo(float32).min`` masks in 16-bit, saturated to the 16-bit
lowest value. So a fill is taken for such a sentinel when

- its magnitude is beyond the 16-bit dtype's largest,
- every value it meets on its way (the data it replaces, what it is added to) is at least
  ``FAR_BEYOND`` times smaller on the calibration inputs, and
- every use of it absorbs a sentinel (softmax, exp, comparisons, attention) or passes it
  on to one that does (``fx16.analysis.calibration.tolerating_sentinels``);

and its number is replaced by fx16's infinity-like sentinel of the same sign (1e38, which
``fx16.ops.numerics`` saturates in 16-bit). On those uses the fp32 program computes the
same: every masked element was already exp's zero.

Reads: what calibration observed (``meta["fx16.observed_range"]``). Writes: the fill's
number, ``meta["fx16.sentinel_fill"]`` (why) on the op; then observes the program again
on the calibration inputs (``calibration``) when it changed one.
"""

import math

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis, recalibrate, tolerating_sentinels
from fx16.contracts import require
from fx16.ops.numerics import INF_LIKE, largest
from fx16.ops.tables import SENTINEL_PASSING_OPS
from fx16.program import Program
from fx16.program.nodes import is_float_tensor, is_number, node_val
from fx16.program.subgraphs import nested_graph_modules

# How far beyond every value it meets a fill must lie to be a sentinel: exp of the
# difference is 0 in fp32 and in fp16 (saturated) by a wide margin.
FAR_BEYOND = 2.0**20

aten = torch.ops.aten
# The fills: the position of the fill's number, and those of the data it replaces.
FILLS = {
    aten.masked_fill.Scalar: (2, (0,)),
    aten.where.ScalarOther: (2, (1,)),
    aten.where.ScalarSelf: (1, (2,)),
    aten.full.default: (1, ()),
    aten.full_like.default: (1, ()),
    aten.new_full.default: (2, ()),
}


class SentinelFillsPass(PassBase):
    """Replace each fill that is a sentinel with 1e38 of its sign (see the module)."""

    preserves = (CalibrationAnalysis,)  # it calibrates the rewritten program again

    def __init__(self, program: Program, low: torch.dtype, calibration: list | None = None) -> None:
        self.program = Program.of(program)
        self.top = largest(low)
        self.calibration = calibration

    def requires(self, graph_module: GraphModule) -> None:
        require(graph_module, type(self).__name__, (CalibrationAnalysis,))

    def call(self, graph_module: GraphModule) -> PassResult:
        changed = False
        for module in nested_graph_modules(graph_module):
            fine = None
            for node in _fills(module.graph):
                where = FILLS[node.target]
                value = node.args[where[0]] if where[0] < len(node.args) else None
                if not (is_number(value) and self.top < abs(value) < INF_LIKE):
                    continue
                fine = tolerating_sentinels(module) if fine is None else fine
                nearest = _largest_met(node, where[1], fine)
                if nearest is None or nearest * FAR_BEYOND > abs(value):
                    continue
                node.args = tuple(
                    math.copysign(INF_LIKE, value) if i == where[0] else arg
                    for i, arg in enumerate(node.args)
                )
                node.meta[meta.SENTINEL_FILL] = (
                    f"{value:g} fills for minus/plus infinity: every value it meets is at "
                    f"most {nearest:.3g} on calibration and every use absorbs it (softmax, "
                    "exp, a comparison), so it is carried as fx16's sentinel 1e38, saturated "
                    "in 16-bit"
                )
                changed = True
        if changed:
            recalibrate(graph_module, self.program, self.calibration)
        return PassResult(graph_module, changed)


def _fills(graph: Graph) -> list[Node]:
    """The nodes of ``graph`` that call a fill, in graph order (found by target)."""
    return sorted(
        node for target in FILLS for node in graph.find_nodes(op="call_function", target=target)
    )


def _largest_met(fill: Node, data: tuple[int, ...], fine: set[Node]) -> float | None:
    """The largest magnitude calibration saw in the data ``fill`` replaces and in every
    value it is combined with on its way to the ops that absorb it; None where a use
    does not absorb it, or one of those values was not observed."""
    if fill not in fine:
        return None
    met = [fill.args[position] for position in data if position < len(fill.args)]
    pending, seen = [fill], set()
    while pending:
        node = pending.pop()
        for user in node.users:
            if (
                user in seen
                or user.op != "call_function"
                or user.target not in SENTINEL_PASSING_OPS
            ):
                continue
            seen.add(user)
            pending.append(user)
            met += [arg for arg in user.all_input_nodes if arg is not node and arg not in seen]
    magnitudes = [
        meta.observed_max_abs(value)
        for value in met
        if isinstance(value, Node) and is_float_tensor(node_val(value))
    ]
    if any(magnitude is None for magnitude in magnitudes):
        return None
    return max(magnitudes, default=0.0)
