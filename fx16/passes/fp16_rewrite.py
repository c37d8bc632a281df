"""Applying a plan: the graph edits the fp16 cast inserter makes, deciding nothing.

``fx16.plan.planner`` decides what every op computes in and what each value becomes; a
``Rewriter`` carries one graph's ``Plan`` out: it narrows or widens an op's inputs
through casts, writes its rounded scalars and 16-bit dtype arguments, its planned
value and decision (``meta["fx16.precision"]``) with the step itself as plain data
(``meta["fx16.planned"]``: the rule that chose, the inputs read narrowed, the cast-back
or why there is none), and gives the consumers of an fp32 result the 16-bit copy the
plan asks for.
"""

import torch
from torch.fx import GraphModule, Node

from fx16.decisions import PRECISION, was_narrowed
from fx16.meta import PLANNED
from fx16.plan.steps import Plan, Step
from fx16.policy import PrecisionPolicy
from fx16.program.casts import (
    INSERTED,
    WHY_CAST_BACK,
    WHY_NARROW,
    WHY_OUTPUT_DTYPE,
    WHY_RETARGETED,
    WHY_UPCAST,
    CastInserter,
    cast_back_source,
    is_inserted,
    set_cast_dtype,
    substitute_inputs,
)
from fx16.program.nodes import FLOAT_DTYPES, float_rank, node_dtype, node_val, set_argument

FP32 = torch.float32


class Rewriter:
    """The edits of one graph's plan, and whether any was made."""

    def __init__(
        self, graph_module: GraphModule, policy: PrecisionPolicy, limit: float, plan: Plan
    ) -> None:
        self.graph_module = graph_module
        self.casts = CastInserter(graph_module.graph)
        self.policy = policy
        self.low = policy.low
        self.limit = limit
        self.plan = plan
        self.modified = False

    def record(self, node: Node, step: Step) -> None:
        """Write the planned decision and value of ``node``, and the step that made them."""
        if step.decision is not None:
            node.meta[PRECISION] = step.decision
            node.meta[PLANNED] = step.planned()
        if step.val is not node_val(node):
            node.meta["val"] = step.val
            self.modified = True

    # ---- computing in 16-bit ------------------------------------------------------------

    def run_in_low(self, node: Node, step: Step) -> None:
        if step.narrowed_inputs:
            narrowed = step.narrowed_inputs
            self.modified = True
            substitute_inputs(
                node,
                lambda arg: self.casts.cast(arg, self.low, WHY_NARROW) if arg in narrowed else arg,
            )
        self.write_arguments(node, step)
        self.record(node, step)

    def write_arguments(self, node: Node, step: Step) -> None:
        for location, value in step.arguments:
            set_argument(node, location, value)
            self.modified = True

    def retarget(self, node: Node, step: Step) -> None:
        """Point the model's cast ``node`` at the 16-bit dtype."""
        set_cast_dtype(node, self.low)
        node.meta[INSERTED] = WHY_RETARGETED
        self.record(node, step)
        self.modified = True

    def creation(self, node: Node, step: Step, dtype: torch.dtype) -> None:
        """A creation op made in ``dtype`` (its ``dtype=`` argument), with its scalars."""
        self.write_arguments(node, step)
        if node.kwargs.get("dtype") != dtype:
            node.kwargs = {**node.kwargs, "dtype": dtype}
            self.modified = True
        self.record(node, step)

    # ---- computing in fp32 --------------------------------------------------------------

    def run_in_fp32(self, node: Node, step: Step) -> None:
        if step.widest is not None:
            self.promote(node, step.widest)
        substitute_inputs(node, self.widened)
        self.record(node, step)
        self.cast_back(node, step)

    def widened(self, arg: Node) -> Node:
        """``arg`` in fp32 if fx16 narrowed it (through a cast), else ``arg`` itself."""
        if not was_narrowed(arg) or node_dtype(arg) != self.low:
            return arg
        self.modified = True
        # Reading a value we cast back from fp32 a moment ago: use the fp32 original.
        return cast_back_source(arg, FP32) or self.casts.cast(arg, FP32, WHY_UPCAST)

    def cast_back(self, node: Node, step: Step) -> None:
        """The 16-bit copy the plan gives ``node``'s consumers (``record`` wrote why it
        gives none, where it does not)."""
        if step.cast_back is not None:
            back = self.casts.cast_after(node, self.low, WHY_CAST_BACK)
            back.meta[PRECISION] = step.cast_back
            self.modified = True

    # ---- following the inputs -----------------------------------------------------------

    def follow(self, node: Node, step: Step) -> None:
        """``node`` computes in the dtype its inputs give it (a promoting op's inputs
        widened to the widest of them first; in 16-bit, its sentinel scalars saturated)."""
        if step.widest is not None:
            self.promote(node, step.widest)
        self.write_arguments(node, step)
        self.record(node, step)
        self.modified = True

    def promote(self, node: Node, widest: torch.dtype) -> None:
        def widen(arg: Node) -> Node:
            dtype = node_dtype(arg)
            if dtype in FLOAT_DTYPES and float_rank(dtype) < float_rank(widest):
                return self.casts.cast(arg, widest, WHY_UPCAST)
            return arg

        substitute_inputs(node, widen)

    # ---- outputs ------------------------------------------------------------------------

    def return_fp32_outputs(self) -> None:
        """Outputs computed in fp32 are returned as fp32 (their cast-backs skipped)."""
        output = self.casts.graph.output_node()
        returned = [
            cast_back_source(value, FP32) or value if isinstance(value, Node) else value
            for value in output.args[0]
        ]
        output.args = (type(output.args[0])(returned), *output.args[1:])

    def restore_output_dtypes(self, required: dict[int, torch.dtype]) -> None:
        """Outputs that keep a dtype get it back, through a cast that feeds only them:
        mutated buffers and inputs (written back in their own dtype), and outputs kept
        by ``keep_io_types``."""
        output = self.casts.graph.output_node()
        returned = list(output.args[0])
        for index, dtype in required.items():
            value = returned[index]
            if not isinstance(value, Node) or node_dtype(value) in (None, dtype):
                continue
            if is_inserted(value) and node_dtype(value.args[0]) == dtype:
                returned[index] = value.args[0]
            else:
                returned[index] = self.casts.cast(value, dtype, WHY_OUTPUT_DTYPE)
        if returned != list(output.args[0]):
            output.args = (type(output.args[0])(returned), *output.args[1:])
            self.modified = True

    def aligned(self, value, dtype: torch.dtype | None):
        """``value`` in ``dtype``, through a cast when it differs (a float operand)."""
        current = node_dtype(value)
        if current not in FLOAT_DTYPES or dtype not in FLOAT_DTYPES or current == dtype:
            return value
        if dtype == FP32:
            return self.widened(value) if was_narrowed(value) else value
        return self.casts.cast(value, dtype, WHY_NARROW)
