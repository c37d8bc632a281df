"""The rules that carry the caller's choices: ``force_fp32`` names, coreai-opt's
``ignored_ops``, and the accuracy budget search's fallbacks.
``fx16.analysis.fp32_rules`` runs them in order."""

from dataclasses import dataclass

from torch.fx import Node

from fx16.analysis.safety_rule import RuleContext
from fx16.decisions import Reason
from fx16.policy.options import IgnoredOps


@dataclass(frozen=True)
class AccuracyBudgetRule:
    """The nodes the accuracy-budget search returned to fp32, by name.

    Before: every op 16-bit, 1.2e-3 off fp32 against a budget of 1e-3. After: the
    search's remedies (a rewrite, then elementwise ops, then the products that matter
    most) in fp32 until the budget holds. Costs: what the search returned, cheapest
    first; the report names each node."""

    names: frozenset[str]
    reason = Reason.ACCURACY_FALLBACK

    @property
    def idle(self) -> bool:
        return not self.names

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return "" if node.name in self.names else None


@dataclass(frozen=True)
class ForcedRule:
    """The nodes the caller's ``force_fp32`` names, by name.

    Before: ``force_fp32=["linear_1"]``, with no budget, reported ``linear_1`` as
    returned to fp32 to meet an accuracy budget. After: ``forced``, naming the option
    and the name that matched. Costs: what the caller asked for."""

    names: frozenset[str]
    reason = Reason.FORCED

    @property
    def idle(self) -> bool:
        return not self.names

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return f"force_fp32={node.name!r}" if node.name in self.names else None


@dataclass(frozen=True)
class IgnoredOpsRule:
    """The ops the caller's ``ignored_ops`` names (coreai-opt's option: ops, a collection
    of them, or a predicate on a node), computed in fp32 with casts at their boundary.

    Before: ``ignored_ops=`` raised ``unknown option(s)``, and a coreai-opt user had to
    translate it into node names. After: ``ignored_ops={torch.ops.aten.exp}`` keeps every
    exp fp32, reported as ``ignored_op``, apart from ``force_fp32``. Costs: what the
    caller asked for."""

    ops: IgnoredOps
    reason = Reason.IGNORED_OP

    @property
    def idle(self) -> bool:
        return not self.ops

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return self.ops.names(node) if node.op == "call_function" and self.ops else None
