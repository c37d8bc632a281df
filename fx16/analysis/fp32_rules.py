"""Fp32RulesAnalysis: the safety rules that keep a node in fp32, as data on the node.

Each rule is a small object that looks at one node and its meta (and, through a
``RuleContext``, the program: its symbolic sizes' bounds) and says whether, and why,
the node must stay fp32 whatever the policy asks (``fx16.analysis.safety_rule``). The
analysis asks the rules in order and publishes the first answer; InsertFP16CastsPass
and the parameter and input converters apply it. A new rule is a new object in the
list (``Fp32RulesAnalysis.standard``), with no change to the pass that rewrites the
graph (docs/development.md walks through one).
"""

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.conditioning import ConditioningAnalysis
from fx16.analysis.facts import Facts
from fx16.analysis.routing import RoutingAnalysis
from fx16.analysis.safety_rule import RuleContext
from fx16.analysis.underflow import UnderflowAnalysis
from fx16.analysis.unsafe_index import UnsafeIndexAnalysis
from fx16.contracts import Analysis
from fx16.decisions import Decision, Reason
from fx16.ops.int_ops import SELECTION_OPS
from fx16.ops.numerics import interval_below_normal
from fx16.ops.tables import NO_LOW_KERNEL_OPS, is_custom_op, overloads
from fx16.program.aliases import storage_owners
from fx16.program.nodes import is_float_tensor, mutated_argument
from fx16.program.propagation import runs_narrowed

FP32 = torch.float32


@dataclass(frozen=True)
class UnsafeIndexRule:
    """A float value that decides an index (positions turned into bucket ids) stays
    fp32: rounding would pick another element. A selection (topk, argmax) is not
    one: its indices are valid whatever it compares (see RouterRule). Reads
    ``meta["fx16.unsafe_index"]``.

    Before: ``(log(p.float() / 8) * 4).long()`` picks bucket 17 in fp32 and 16 in fp16.
    After: the log, the scale and the floor stay fp32; the embedding they index runs
    16-bit. Costs: the elementwise chain's bytes, no product FLOPs."""

    needs = (UnsafeIndexAnalysis,)
    reason = Reason.UNSAFE_INDEX

    def applies(self, node: Node, context: RuleContext) -> str | None:
        marked = meta.flows_into_index(node)
        return "" if marked and node.target not in SELECTION_OPS else None


@dataclass(frozen=True)
class AccuracyBudgetRule:
    """The nodes the accuracy-budget search returned to fp32, by name.

    Before: every op 16-bit, 1.2e-3 off fp32 against a budget of 1e-3. After: the
    search's remedies (a rewrite, then elementwise ops, then the products that matter
    most) in fp32 until the budget holds. Costs: what the search returned, cheapest
    first; the report names each node."""

    names: frozenset[str]
    reason = Reason.ACCURACY_FALLBACK

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

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return f"force_fp32={node.name!r}" if node.name in self.names else None


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
    reason = Reason.ACTIVATION_OVERFLOW

    def applies(self, node: Node, context: RuleContext) -> str | None:
        if node.op != "call_function":
            return None
        return (
            f"observed {meta.observed_max_abs(node):.4g}"
            if meta.overflows(node, self.limit)
            else None
        )

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
    reason = Reason.ACTIVATION_BELOW_RANGE

    def applies(self, node: Node, context: RuleContext) -> str | None:
        if node.op != "call_function" or not is_float_tensor(node.meta.get("val")):
            return None
        if meta.negligible(node) or meta.rounding_cancels(node):
            return None  # a stable rewrite's term whose loss it proved harmless
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
class FakeKernelRule:
    """A custom op whose fake kernel refuses ``low`` inputs (or that has none) keeps
    its inputs as exported: nothing can say what it computes on 16-bit values.

    Before: ``torch.ops.mylib.fused(x)`` registered for fp32 only fails on fp16 input.
    After: it reads fp32 inputs (cast up) and its result is cast back. Costs: the
    custom op's own FLOPs in fp32."""

    low: torch.dtype
    reason = Reason.NO_FAKE_KERNEL

    def applies(self, node: Node, context: RuleContext) -> str | None:
        custom = node.op == "call_function" and is_custom_op(node.target)
        return "" if custom and not runs_narrowed(node, self.low) else None


@dataclass(frozen=True)
class NoLowKernelRule:
    """An ATen op with no 16-bit kernel (``NO_LOW_KERNEL_OPS``: FFTs, factorizations,
    special functions) computes in fp32, as eager autocast runs it.

    Before: ``torch.fft.fftn(linear(x)).real`` cast to fp16 raises "Unsupported dtype
    Half" on the CPU, where the fp32 program runs. After: the linear stays 16-bit, the
    FFT reads its result cast up, and its readers take a 16-bit copy of what it gives.
    Costs: the op's own FLOPs in fp32, and one cast on each side."""

    reason = Reason.NO_LOW_KERNEL

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return "" if node.op == "call_function" and node.target in NO_LOW_KERNEL_OPS else None


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
class UnderflowRule:
    """An op singular at zero whose argument would flush to zero or be subnormal in
    16-bit, and its elementwise past. Reads ``meta["fx16.underflow"]``.

    Before: ``log(sigmoid(z))`` with logits of -20 gives ``log(0) = -inf`` in fp16.
    After: the sigmoid and the log compute in fp32 (where no stable rewrite holds;
    ``log_sigmoid`` does, and is preferred). Costs: the short chain from the small
    value's source to the singular op, no product FLOPs."""

    needs = (UnderflowAnalysis,)
    reason = Reason.UNDERFLOW

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return meta.underflows(node)


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
    ) -> "Fp32RulesAnalysis":
        """fx16's rules, safety first: index, the caller's force_fp32, the accuracy
        budget's choices, observed overflow, custom
        ops without a 16-bit fake kernel, ATen ops without a 16-bit kernel, underflow,
        conditioning, values observed below the normal range (the more specific causes
        first); then the policy's routers."""
        return cls(
            [
                UnsafeIndexRule(),
                ForcedRule(frozenset(force_fp32)),
                AccuracyBudgetRule(frozenset(fallback)),
                ObservedOverflowRule(limit),
                FakeKernelRule(low),
                NoLowKernelRule(),
                UnderflowRule(),
                ConditioningRule(),
                ObservedBelowRangeRule(low),
                RouterRule(),
            ],
            program,
        )

    def call(self, graph_module: GraphModule) -> PassResult:
        overflow = [rule for rule in self.rules if isinstance(rule, ObservedOverflowRule)]
        for submodule in Facts.of(graph_module).graph_modules:
            written = overflow[0].written_over(submodule.graph) if overflow else {}
            context = RuleContext(self.program, submodule)
            for node in submodule.graph.nodes:
                node.meta.pop(self.META_KEY, None)
                if node.op not in ("placeholder", "call_function"):
                    continue
                for rule in self.rules:
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


def fp32_rule(node: Node) -> Decision | None:
    """The rule keeping ``node`` in fp32, as Fp32RulesAnalysis published it."""
    return meta.fp32_rule(node)
