"""Fp32RulesAnalysis: the safety rules that keep a node in fp32, as data on the node.

Each rule is a small object that looks at one node and its meta (and, through a
``RuleContext``, the program: its symbolic sizes' bounds) and says whether, and why,
the node must stay fp32 whatever the policy asks (``fx16.analysis.safety_rule``). The
analysis asks the rules in order and publishes the first answer; InsertFP16CastsPass
and the parameter and input converters apply it. The rules live in
``fx16.analysis.safety_rules``, one module per family of cause; a new rule is a new
object there and in the list (``Fp32RulesAnalysis.standard``), with no change to the
pass that rewrites the graph (docs/development.md walks through one).
"""

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.facts import Facts
from fx16.analysis.safety_rule import RuleContext
from fx16.analysis.safety_rules.choices import AccuracyBudgetRule, ForcedRule, IgnoredOpsRule
from fx16.analysis.safety_rules.index import UnsafeIndexRule
from fx16.analysis.safety_rules.kernels import FakeKernelRule, NoLowKernelRule
from fx16.analysis.safety_rules.precision import (
    AccumulatingStateRule,
    ConditioningRule,
    RouterRule,
)
from fx16.analysis.safety_rules.range import (
    ObservedBelowRangeRule,
    ObservedOverflowRule,
    UnderflowRule,
)
from fx16.contracts import Analysis
from fx16.decisions import Decision, Reason
from fx16.policy.options import Fp16Options, IgnoredOps

FP32 = torch.float32


class Fp32RulesAnalysis(Analysis):
    """Ask each rule about every node (nested bodies too); publish the first answer.

    Requires: the analyses its rules read (each rule's ``needs``) to have run; a
    pipeline that leaves one out gets a ``PreconditionError`` naming it.

    Writes: ``node.meta["fx16.fp32_rule"]``, a ``Decision(torch.float32, reason,
    detail)``, on each node a rule keeps in fp32; absent elsewhere. Also
    ``graph_module.meta["fx16.fp32_rules"]``: the rules' class names, in order.
    """

    META_KEY = meta.FP32_RULE
    RAN_KEY = meta.FP32_RULES_RAN

    def __init__(self, rules: list, program=None) -> None:
        """``program``: what the rules' ``RuleContext`` gives them (None: a graph asked
        on its own)."""
        self.rules, self.program = list(rules), program
        # the analyses whose facts the rules read (a rule's ``needs``)
        needs = (analysis for rule in self.rules for analysis in getattr(rule, "needs", ()))
        self.needs = tuple(dict.fromkeys(needs))

    @classmethod
    def needing_nothing(
        cls,
        low: torch.dtype,
        limit: float,
        force_fp32: frozenset[str] = frozenset(),
        fallback: frozenset[str] = frozenset(),
    ) -> "Fp32RulesAnalysis":
        """The standard rules that read no analysis (the caller's and the budget's
        names, custom ops without a 16-bit fake kernel, ...): for a pipeline that runs
        none."""
        rules = cls.standard(low, limit, force_fp32, fallback).rules
        return cls([rule for rule in rules if not getattr(rule, "needs", ())])

    @classmethod
    def standard(
        cls,
        low: torch.dtype,
        limit: float,
        force_fp32: frozenset[str] = frozenset(),
        fallback: frozenset[str] = frozenset(),
        program=None,
        options: Fp16Options | None = None,
    ) -> "Fp32RulesAnalysis":
        """fx16's rules, safety first: index, the caller's force_fp32 and ignored_ops,
        the accuracy budget's choices, observed overflow, custom
        ops without a 16-bit fake kernel, ATen ops without a 16-bit kernel, underflow,
        conditioning, values observed below the normal range (the more specific causes
        first); then the policy's routers. ``options``: the cast's, whose ``force_fp32``,
        ``ignored_ops`` and ``fallback`` replace the arguments'."""
        ignored = IgnoredOps()
        if options is not None:
            force_fp32, fallback = options.force_fp32, options.fallback
            ignored = IgnoredOps.of(options.ignored_ops)
        return cls(
            [
                UnsafeIndexRule(),
                ForcedRule(frozenset(force_fp32)),
                IgnoredOpsRule(ignored),
                AccuracyBudgetRule(frozenset(fallback)),
                ObservedOverflowRule(limit),
                FakeKernelRule(low),
                NoLowKernelRule(),
                UnderflowRule(),
                ConditioningRule(),
                ObservedBelowRangeRule(low),
                AccumulatingStateRule(),
                RouterRule(),
            ],
            program,
        )

    def call(self, graph_module: GraphModule) -> PassResult:
        overflow = [rule for rule in self.rules if isinstance(rule, ObservedOverflowRule)]
        asked = [rule for rule in self.rules if not getattr(rule, "idle", False)]
        for submodule in Facts.of(graph_module).graph_modules:
            held = _meta_keys(submodule)
            here = [rule for rule in asked if _may_apply(rule, held)]
            observed = overflow and _may_apply(overflow[0], held)
            written = overflow[0].written_over(submodule.graph) if observed else {}
            context = RuleContext(self.program, submodule)
            for node in submodule.graph.nodes:
                node.meta.pop(self.META_KEY, None)
                if node.op not in ("placeholder", "call_function"):
                    continue
                for rule in here:
                    detail = rule.applies(node, context)
                    if detail is not None:
                        node.meta[self.META_KEY] = Decision(FP32, rule.reason, detail)
                        break
                else:
                    if node in written:
                        decided = Decision(FP32, Reason.ACTIVATION_OVERFLOW, written[node])
                        node.meta[self.META_KEY] = decided
        graph_module.meta[self.RAN_KEY] = [type(rule).__name__ for rule in self.rules]
        return PassResult(graph_module, False)


def _meta_keys(graph_module: GraphModule) -> set[str]:
    """Every meta key some node of ``graph_module``'s graph holds."""
    held: set[str] = set()
    for node in graph_module.graph.nodes:
        held.update(node.meta)
    return held


def _may_apply(rule, held: set[str]) -> bool:
    """``rule`` may apply to a node of a graph whose nodes hold the meta keys ``held``:
    it declares no ``markers``, or one of them is held."""
    markers = getattr(rule, "markers", None)
    return markers is None or not held.isdisjoint(markers)


def fp32_rule(node: Node) -> Decision | None:
    """The rule keeping ``node`` in fp32, as Fp32RulesAnalysis published it."""
    return meta.fp32_rule(node)
