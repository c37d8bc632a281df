"""What the precedence rules read of one node: a ``View``.

A ``View`` reads the node's inputs as ``fx16.plan.planner``'s plan says they will be (or
as the graph holds them now), once, and the node's scalars and policy entry on first
use. The rules of ``fx16.plan.precedence`` and the planner ask it; it changes nothing.
"""

import torch
from torch.fx import Node

from fx16 import meta
from fx16.decisions import reasons
from fx16.ops.numerics import interval_below_normal, scalar_overflows, smallest_normal
from fx16.plan.steps import Plan, Read, graph_read
from fx16.policy import Precision, PrecisionPolicy
from fx16.program.nodes import (
    FLOAT_DTYPES,
    SIXTEEN_BIT_DTYPES,
    has_fp32_part,
    tensor_leaves,
    value_scalars,
)

FP32 = torch.float32


class View:
    """What the rules read of one node, each fact computed once (the lazy ones on
    first use). Its inputs are read as ``plan`` says they will be (None: as the graph
    holds them now)."""

    __slots__ = (
        "node",
        "policy",
        "limit",
        "plan",
        "float_inputs",
        "fp32_inputs",
        "narrowed_input",
        "other_float",
        "produces_fp32",
        "_precision",
        "_scalars",
    )

    def __init__(
        self, node: Node, policy: PrecisionPolicy, limit: float, plan: Plan | None = None
    ) -> None:
        self.node = node
        self.policy = policy
        self.limit = limit  # calibration magnitudes above it overflow 16-bit (with the margin)
        self.plan = plan
        self.float_inputs, self.fp32_inputs = [], []  # the float tensor inputs; the fp32 ones
        self.narrowed_input = False  # a float input fx16 narrowed
        self.other_float: Read | None = None  # the first float input neither 16-bit nor fp32
        low = policy.low
        known = plan.reads if plan is not None and not plan.redirects else {}
        for arg in node.all_input_nodes:
            read = known.get(arg)  # the plan's read of an input nothing redirects
            if read is None:
                read = plan.read(arg, node) if plan is not None else graph_read(arg)
            val = read.val
            if not isinstance(val, torch.Tensor) or val.dtype not in FLOAT_DTYPES:
                continue
            self.float_inputs.append(arg)
            if val.dtype == FP32:
                self.fp32_inputs.append(arg)
            elif val.dtype != low and self.other_float is None:
                self.other_float = read
            if read.decision is not None and read.decision.narrowed:
                self.narrowed_input = True
        self.produces_fp32 = has_fp32_part(node.meta.get("val"))
        self._precision = self._scalars = None

    def read(self, arg: Node) -> Read:
        """What the node reads of its input ``arg``."""
        return self.plan.read(arg, self.node) if self.plan is not None else graph_read(arg)

    def island(self, arg: Node) -> bool:
        """``arg`` is kept fp32 as part of a region the model asks for explicitly."""
        return self.read(arg).island

    @property
    def low(self) -> torch.dtype:
        return self.policy.low

    @property
    def precision(self) -> Precision:
        if self._precision is None:
            self._precision = self.policy.precision_for(self.node)
        return self._precision

    @property
    def produces_16bit(self) -> bool:
        """The node's recorded result holds 16-bit floats and no fp32 (the model computes
        it in 16-bit itself)."""
        if self.produces_fp32:  # the common case, known already
            return False
        leaves = tensor_leaves(self.node.meta.get("val"))
        return any(leaf.dtype in SIXTEEN_BIT_DTYPES for leaf in leaves)

    @property
    def scalars(self) -> list:
        if self._scalars is None:
            self._scalars = value_scalars(self.node)
        return self._scalars

    def entry(self) -> str:
        """The policy entry that matched the node ("ops['softmax'] = fp32")."""
        return self.policy.matching_entry(self.node)[1]

    def overflowing_scalar(self) -> float | None:
        """A scalar argument beyond the 16-bit range, if any."""
        for _, value in self.scalars:
            if scalar_overflows(value, self.low):
                return value
        return None

    def downcastable(self, value: Node) -> bool:
        """An fp32 value kept wide for precision (by the policy, the accuracy budget for
        some of its uses, or a loop carrying it), not by a safety rule, and that fits
        16-bit, above and below (a value wholly below the normal range would reach the
        reader as subnormals), and holds no infinity-like sentinel (cast down, its -1e38
        is -inf, not the -65504 fx16 saturates it to: a row masked whole turns nan): a
        16-bit op reading it may cast it down, as eager autocast does with weights."""
        decision = self.read(value).decision
        return (
            decision is not None
            and decision.reason in DOWNCASTABLE
            and meta.carried_by_cast(value, self.limit, smallest_normal(self.low))
        )

    def below_normal(self, value: Node) -> bool:
        """Every value calibration saw ``value`` hold lies below the 16-bit normal range."""
        largest = meta.observed_max_abs(value)
        return bool(largest) and interval_below_normal((-largest, largest), self.policy.low)


# Reasons an fp32 value may have that still let a 16-bit op read it through a cast
# (declared per reason: ``fx16.decisions.REASON_SPECS``).
DOWNCASTABLE = reasons(downcastable=True)
