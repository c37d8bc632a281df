"""The range rules: values observed beyond 16-bit's range or below its normal range, and
values that would flush to zero where an op is singular.
``fx16.analysis.fp32_rules`` runs them in order."""

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.safety_rule import RuleContext
from fx16.analysis.underflow import UnderflowAnalysis
from fx16.decisions import Reason
from fx16.ops.numerics import interval_below_normal
from fx16.ops.tables import overloads
from fx16.program.aliases import storage_owners
from fx16.program.nodes import is_float_tensor, mutated_argument


@dataclass(frozen=True)
class ObservedOverflowRule:
    """An op whose values on the calibration inputs exceed ``limit`` (the 16-bit
    maximum over the overflow margin) computes in fp32. Reads
    ``meta["fx16.observed_range"]``.

    Before: a T5 feed-forward whose activations reach 7e4 gives inf in fp16. After:
    that op computes in fp32 and its consumers read a 16-bit copy where it fits.
    Costs: the op's FLOPs in fp32 (often an elementwise op; a product only where the
    product itself overflows)."""

    limit: float
    needs = (CalibrationAnalysis,)
    markers = (meta.OBSERVED_MAX_ABS,)
    reason = Reason.ACTIVATION_OVERFLOW

    def applies(self, node: Node, context: RuleContext) -> str | None:
        if node.op != "call_function":
            return None
        return meta.observed_said(node) if meta.overflows(node, self.limit) else None

    def written_over(self, graph) -> dict[Node, str]:
        """The ops whose storage a write in place that overflows reaches (``h = x * 1``,
        then ``h.add_(y)`` of 1e5): an in-place op cannot change its target's dtype, so
        the op that made the target computes in fp32, and the write lands in fp32."""
        found = {}
        for node in graph.nodes:
            target = mutated_argument(node) if node.op == "call_function" else None
            if target is not None and meta.overflows(node, self.limit):
                said = f"a write in place ({node.name}) of {meta.observed_max_abs(node):.4g}"
                for owner in storage_owners(target):
                    found.setdefault(owner, said)
        return found


TENSOR_SUMS = overloads("add.Tensor", "sub.Tensor")


@dataclass(frozen=True)
class ObservedBelowRangeRule:
    """An op whose every value on the calibration inputs lies below the 16-bit normal
    range (one nonzero) computes in fp32: in 16-bit it is subnormal or zero, and what
    reads it (a scale back up, a division) gets the loss. Reads
    ``meta["fx16.observed_range"]``.

    Before: ``lin(x) * 1e-8 * 1e8`` gives all zeros in fp16, reported as fitting.
    After: the two multiplies compute in fp32 (the second reads the first's fp32
    result) and the linear stays 16-bit. Costs: the op and its readers' FLOPs in fp32
    (elementwise, or a product that reads a weight below the range)."""

    low: torch.dtype
    needs = (CalibrationAnalysis,)
    markers = (meta.OBSERVED_MAX_ABS,)
    reason = Reason.ACTIVATION_BELOW_RANGE

    def applies(self, node: Node, context: RuleContext) -> str | None:
        if node.op != "call_function" or meta.negligible(node) or meta.rounding_cancels(node):
            return None  # (negligible: a stable rewrite's term whose loss it proved harmless)
        if isinstance(node.meta.get("val"), (tuple, list)):  # judged by each result read
            for user in node.users:
                found = self._below(user) if user.target is operator.getitem else None
                if found is not None:
                    return f"{user.name} {found}"
            return None
        return self._below(node)

    def _below(self, node: Node) -> str | None:
        """Why ``node``'s value is below the normal range where nothing absorbs it."""
        if not is_float_tensor(node.meta.get("val")):
            return None
        largest = meta.observed_max_abs(node)
        if largest is None or not interval_below_normal((-largest, largest), self.low):
            return None
        if node.users and all(self._absorbed_by(user) for user in node.users):
            return None
        tiny = torch.finfo(self.low).tiny
        return f"observed at most {largest:.3g}, below the smallest normal {tiny:.3g}"

    def _absorbed_by(self, user: Node) -> bool:
        """``user`` adds the value to a tensor and reaches the normal range: a subnormal
        addend's rounding (at most half the smallest subnormal) is below the sum's."""
        if user.op != "call_function" or user.target not in TENSOR_SUMS:
            return False
        largest = meta.observed_max_abs(user)
        return largest is not None and not interval_below_normal((-largest, largest), self.low)


@dataclass(frozen=True)
class UnderflowRule:
    """An op singular at zero whose argument would flush to zero or be subnormal in
    16-bit, and its elementwise past. Reads ``meta["fx16.underflow"]``.

    Before: ``log(sigmoid(z))`` with logits of -20 gives ``log(0) = -inf`` in fp16.
    After: the sigmoid and the log compute in fp32 (where no stable rewrite holds;
    ``log_sigmoid`` does, and is preferred). Costs: the short chain from the small
    value's source to the singular op, no product FLOPs."""

    needs = (UnderflowAnalysis,)
    markers = (meta.UNDERFLOW,)
    reason = Reason.UNDERFLOW

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return meta.underflows(node)
