"""The precision rules: cancellations 16-bit rounding would spoil, and routers whose
choices decide an index.
``fx16.analysis.fp32_rules`` runs them in order."""

from dataclasses import dataclass

from torch.fx import Node

from fx16 import meta
from fx16.analysis.conditioning import ConditioningAnalysis
from fx16.analysis.routing import RoutingAnalysis
from fx16.analysis.safety_rule import RuleContext
from fx16.decisions import Reason


@dataclass(frozen=True)
class ConditioningRule:
    """An op the conditioning analysis found ill-conditioned, and the values it reads.
    Reads ``meta["fx16.ill_conditioned"]``.

    Before: ``x - x.mean()`` on values near 1000 with a spread of 0.1 loses every
    digit in fp16 (a condition number of 1e4). After: the subtraction and what it
    reads stay fp32 (per slice: one narrow column is judged apart from wide ones).
    Costs: elementwise ops and reductions, no product FLOPs unless a product is
    itself ill-conditioned."""

    needs = (ConditioningAnalysis,)
    reason = Reason.ILL_CONDITIONED

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return meta.ill_conditioned(node)


@dataclass(frozen=True)
class RouterRule:
    """A router op the policy keeps in fp32 (``routing="fp32"``). Reads
    ``meta["fx16.router"]``.

    Before: a mixture-of-experts gate's top-k picks another expert when its scores
    round to 16-bit. After: the gate's product (where it costs at most 1% of the
    product FLOPs), softmax and top-k stay fp32. Costs: that small product and the
    selection; ``routing="16-bit"`` pays nothing and lets the choice change."""

    needs = (RoutingAnalysis,)
    reason = Reason.ROUTER

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return meta.routes(node)
