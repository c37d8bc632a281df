"""Applying a precision choice: the graph edits the fp16 cast inserter makes.

``fx16.precedence`` decides what an op computes in; a ``Rewriter`` carries it out on
one graph: it narrows or widens the op's inputs through casts, rounds its scalars,
retypes its dtype arguments and recorded value, records the decision in
``meta["fx16.precision"]``, and gives the consumers of an fp32 result a 16-bit copy
where calibration shows it fits (a cast-back; where it skips one, it says why in
``meta["fx16.cast_back_skipped"]``).
"""

import torch
from torch.fx import GraphModule, Node

from fx16 import meta
from fx16.casts import (
    INSERTED,
    WHY_CAST_BACK,
    WHY_NARROW,
    WHY_OUTPUT_DTYPE,
    WHY_RETARGETED,
    WHY_UPCAST,
    CastInserter,
    cast_back_source,
    is_cast,
    is_inserted,
    set_cast_dtype,
    substitute_inputs,
)
from fx16.decisions import PRECISION, Reason, decide, decision_of, was_narrowed
from fx16.nodes import (
    FLOAT_DTYPES,
    dtype_arguments,
    float_rank,
    has_fp32_part,
    node_dtype,
    node_val,
    set_argument,
    tensor_inputs,
    tensor_leaves,
    value_scalars,
)
from fx16.numerics import round_scalar_to_fp16, smallest_subnormal
from fx16.ops import is_custom_op
from fx16.policy import PrecisionPolicy
from fx16.precedence import Choice, View
from fx16.propagation import narrowed_result, output_dtypes_by_running, propagate_fake

FP32 = torch.float32


def decide_island(node: Node, dtype: torch.dtype) -> None:
    """Record ``dtype`` for ``node`` with the reason its island verdict gives: inside a
    kept region, or the model's fp32 cast made 16-bit, and the evidence; an ordinary
    fit for a node that opens no region."""
    verdict = meta.island_verdict(node)
    if verdict is None:
        decide(node, dtype, Reason.FITS)
    else:
        kept = verdict.keep and dtype == FP32
        reason = Reason.EXPLICIT_FP32 if kept else Reason.EXPLICIT_FP32_RETARGETED
        decide(node, dtype, reason, detail=verdict.why)


class Rewriter:
    """The edits of one walk over one graph, and whether any was made."""

    def __init__(
        self,
        graph_module: GraphModule,
        policy: PrecisionPolicy,
        limit: float,
        calibrated: bool = True,
    ) -> None:
        self.graph_module = graph_module
        self.casts = CastInserter(graph_module.graph)
        self.policy = policy
        self.low = policy.low
        self.limit = limit
        # Without observations (a cond branch calibration did not take) a value forced to
        # fp32 stays fp32 (no cast-back): nothing shows that it fits fp16 again.
        self.calibrated = calibrated
        self.modified = False

    def view(self, node: Node) -> View:
        return View(node, self.policy, self.limit)

    # ---- computing in 16-bit ------------------------------------------------------------

    def run_in_low(self, node: Node, choice: Choice, view: View) -> None:
        if view.fp32_inputs:
            self.downcast_inputs(node, view)
        clamped = []
        for location, value in view.scalars:
            rounded = round_scalar_to_fp16(value, self.low) if isinstance(value, float) else value
            if rounded != value:
                set_argument(node, location, rounded)
                self.modified = True
                if value and abs(value) < smallest_subnormal(self.low):
                    clamped.append((value, rounded))
        for location, dtype in dtype_arguments(node):
            if dtype == FP32:
                set_argument(node, location, self.low)
                self.modified = True
        result = narrowed_result(node, self.low, view.produces_fp32)
        if result is not node_val(node):
            node.meta["val"] = result
            self.modified = True
        if is_custom_op(node.target) and has_fp32_part(result):
            decide(node, FP32, Reason.FIXED_OUTPUT_DTYPE)
            return
        decide_island(node, self.low)
        if decision_of(node).reason != Reason.FITS:
            return
        if meta.refuted(node):
            decide(node, self.low, Reason.NOT_WORTH_FP32, detail=meta.refuted(node))
        elif clamped:
            scalars = ", ".join(f"{value:g} -> {new:.3g}" for value, new in clamped)
            decide(node, self.low, Reason.SCALAR_CLAMPED, detail=scalars)
        elif choice.detail:
            decide(node, self.low, Reason.FITS, detail=choice.detail)

    def downcast_inputs(self, node: Node, view: View) -> None:
        def downcast(arg: Node) -> Node:
            if node_dtype(arg) != FP32 or not view.downcastable(arg):
                return arg
            self.modified = True
            return self.casts.cast(arg, self.low, WHY_NARROW)

        substitute_inputs(node, downcast)

    def retarget(self, node: Node, dtype: torch.dtype) -> None:
        """Point the model's cast ``node`` at ``dtype``."""
        set_cast_dtype(node, dtype)
        node.meta[INSERTED] = WHY_RETARGETED
        decide_island(node, dtype)
        self.modified = True

    # ---- computing in fp32 --------------------------------------------------------------

    def run_in_fp32(self, node: Node, choice: Choice, produces_fp32: bool) -> None:
        substitute_inputs(node, self.widened)
        decide(node, FP32, choice.reason, detail=choice.detail)
        if isinstance(node_val(node), torch.Tensor) and produces_fp32 and choice.cast_back:
            self.cast_back(node, choice.reason)

    def widened(self, arg: Node) -> Node:
        """``arg`` in fp32 if fx16 narrowed it (through a cast), else ``arg`` itself."""
        if not was_narrowed(arg) or node_dtype(arg) != self.low:
            return arg
        self.modified = True
        # Reading a value we cast back from fp32 a moment ago: use the fp32 original.
        return cast_back_source(arg, FP32) or self.casts.cast(arg, FP32, WHY_UPCAST)

    def cast_back(self, node: Node, reason: Reason) -> None:
        """Give the consumers of an fp32 result a 16-bit value, unless it does not fit.

        Casts among the consumers convert anyway, so a node used only by casts gets
        none. A skipped cast-back is recorded with its cause."""
        skipped = self.cast_back_skipped(node)
        if skipped:
            node.meta[meta.CAST_BACK_SKIPPED] = skipped
            return
        back = self.casts.cast_after(node, self.low, WHY_CAST_BACK)
        decide(back, self.low, reason)
        self.modified = True

    def cast_back_skipped(self, node: Node) -> str:
        """Why ``node``'s consumers read it in fp32 ("" when they get a 16-bit copy)."""
        if not self.calibrated:
            return "no calibration run reached it: nothing shows it fits 16-bit"
        if meta.overflows(node, self.limit):
            return f"observed {meta.observed_max_abs(node):.4g}, beyond 16-bit with the margin"
        if all(is_cast(user) for user in node.users):
            return "its consumers are casts, which convert it themselves"
        return ""

    # ---- following the inputs -----------------------------------------------------------

    def follow(self, node: Node, choice: Choice, promote: bool) -> None:
        """Run ``node`` in the dtype its inputs give it (``promote``: their widest first)."""
        if promote:
            inputs = [arg for arg in tensor_inputs(node) if node_dtype(arg) in FLOAT_DTYPES]
            widest = max((node_dtype(arg) for arg in inputs), key=float_rank, default=None)

            def widen(arg: Node) -> Node:
                if node_dtype(arg) in FLOAT_DTYPES and node_dtype(arg) != widest:
                    return self.casts.cast(arg, widest, WHY_UPCAST)
                return arg

            substitute_inputs(node, widen)
        input_dtypes = {node_dtype(a) for a in tensor_inputs(node) if node_dtype(a) in FLOAT_DTYPES}
        try:
            result = propagate_fake(node)
            if len(input_dtypes) > 1:  # mixed float inputs: trust a real kernel, not the meta one
                result = output_dtypes_by_running(node, result)
        except RuntimeError:
            if promote or len(input_dtypes) < 2:
                raise
            # the op cannot mix float dtypes (a convolution with bf16 input, fp32 weight):
            # it runs in the widest of them
            self.follow(node, choice, promote=True)
            return
        dtypes = {leaf.dtype for leaf in tensor_leaves(result) if leaf.is_floating_point()}
        scalar_overflow = any(
            round_scalar_to_fp16(float(v), self.low) is None for _, v in value_scalars(node)
        )
        if self.low in dtypes and scalar_overflow:  # safety first: the scalar needs fp32
            fp32 = Choice(choice.action, Reason.SCALAR_OVERFLOW, cast_back=self.policy.cast_back)
            self.run_in_fp32(node, fp32, True)
            return
        node.meta["val"] = result
        dtype = self.low if self.low in dtypes else FP32
        decide(node, dtype, Reason.POLICY_FOLLOW, detail=choice.detail)
        self.modified = True

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

    def inherit(self, node: Node, source: Node) -> None:
        """``node`` carries ``source``'s decision (an in-place op, a body's placeholder)."""
        if decision_of(source) is not None:
            node.meta[PRECISION] = decision_of(source)
