"""VerdictCheckAnalysis: fp32 verdicts that cost something are checked on the calibration inputs.

A safety rule fires on a pattern - a value beyond 65504 with the margin, an op with
a condition number above the tolerance, an fp32 region the model wrote - without
knowing what its verdict buys. Two kinds of verdict are worth asking:

- one that puts a matrix product, convolution or attention in fp32 (the range rule
  on the product's own output, a region of the model's that holds one), when it costs
  at least ``HEAVY_SHARE`` of the program's product FLOPs: on a GPU or the Neural
  Engine that op then runs 8-16x slower;
- a conditioning finding whose condition number is moderate (below ``MODERATE``
  times what the tolerance allows: GELU's cube has 3): the rounding it amplifies
  may be damped by what follows (the cube is scaled by 0.044715 and added to x).

(A router the policy keeps in fp32, ``routing="fp32"``, is the policy's choice, and is
not asked.) Each is measured with ``fx16.analysis.emulation``: the output error on the
calibration inputs with every verdict, and without that one. It holds when the error
without it exceeds ``MEASURABLE`` times the error with it (or is not finite); otherwise
it is dropped, and its nodes say why. Before any whole run, a question whose nodes'
consumers compute bit-identical values either way (replayed over what they depend on
alone, when that is a small part of the program: a GELU's cube kept fp32, which its
16-bit reader reads through a cast, as a 16-bit cube would round it) is dropped without
one. Verdicts of one kind in
different layers (the same rule and op at the same module path up to the layer
index) are measured together:
twelve GELU cubes are one question, not twelve. The most expensive are asked first,
and each answer is kept for the next question. A dropped conditioning verdict withdraws
what was kept for it: the values kept in fp32 only to feed the ops whose verdicts were
dropped (a rotary embedding's angles, once its cos and sin compute in 16-bit, read them
rounded to 16-bit) are one last question. A question whose nodes compute at most
``CHEAP_SHARE`` of the program's elementwise work, with no product among them (a rotary
embedding's cos and sin, tables of positions by head width), holds without a run: fp32
there costs no device anything it notices, and the gain it buys, real over many calls
(0.90x ``.half()``'s error over 64 inputs on a Llama with massive activations, 1.02x with
the angles rounded to 16-bit), is below what one calibration input resolves.
With no calibration input there is nothing to measure with, and every verdict holds.

Reads: ``meta["fx16.fp32_rule"]`` (Fp32RulesAnalysis), the fp32 outputs calibration
recorded (``graph_module.meta["fx16.calibration_outputs"]``), the island verdicts
(ExplicitFp32Analysis), the conditioning findings
(``meta["fx16.conditioning"]``), the policy. Writes: on the nodes of a
dropped verdict, ``meta["fx16.fp32_rule"]`` removed (an island's verdict made
16-bit) and ``meta["fx16.not_worth_fp32"]``: why; in
``graph_module.meta["fx16.verdict_checks"]`` one ``Check`` per question asked.
"""

import math
from dataclasses import dataclass, replace

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.calibration_inputs import calibration_calls
from fx16.analysis.conditioning import ConditioningAnalysis
from fx16.analysis.emulation import Emulation
from fx16.analysis.explicit_fp32 import ExplicitFp32Analysis, islands
from fx16.analysis.facts import Facts
from fx16.analysis.fp32_rules import Fp32RulesAnalysis, fp32_rule
from fx16.analysis.verdict_questions import (
    Question,
    cheap_work,
    droppable,
    findings_of,
    is_cheap,
    live_islands,
    orphaned_chains,
    pattern,
)
from fx16.contracts import Analysis
from fx16.decisions import Reason, reasons
from fx16.ops.numerics import largest, smallest_normal
from fx16.policy import Precision, PrecisionPolicy
from fx16.program import Program
from fx16.program.cost import flops, is_product
from fx16.program.nodes import op_label

# A verdict that puts at least this share of the program's product FLOPs in fp32 is heavy.
HEAVY_SHARE = 0.005
# A conditioning finding below this many times the tolerance is moderate.
MODERATE = 16.0
# fp32 must lower the error by at least this factor to pay for itself.
MEASURABLE = 1.25


@dataclass(frozen=True)
class Check:
    """One question: does keeping ``nodes`` in fp32 lower the output error?"""

    label: str  # what is kept, e.g. "ill_conditioned pow.Tensor_Scalar at transformer.h.*.mlp"
    nodes: tuple[str, ...]
    error_with: float | None  # None where no run was needed (identical)
    error_without: float | None
    held: bool
    identical: bool = False  # the consumers compute the same values either way: not run
    cheap: bool = False  # its nodes are a negligible share of the program's work: held, not run


class VerdictCheckAnalysis(Analysis):
    """Measure the costly and the moderate fp32 verdicts; drop those fp32 does not pay
    for (see the module)."""

    META_KEY = meta.NOT_WORTH_FP32
    CHECKS_KEY = meta.VERDICT_CHECKS
    needs = (Fp32RulesAnalysis,)

    def __init__(
        self,
        program: Program,
        policy: PrecisionPolicy | None = None,
        calibration: list | None = None,
        answers: dict[str, str | None] | None = None,
        limit: float | None = None,
    ) -> None:
        """``limit``: the largest magnitude a value may hold and be cast to 16-bit (the
        16-bit maximum over the overflow margin; default: the maximum itself).
        ``answers``: by label, why each kind of verdict was dropped (None: it held),
        from an earlier cast of the same program (the accuracy search casts it again
        and again): kinds found there are not measured again, and new answers are
        added to it."""
        self.program = Program.of(program)
        self.policy = policy or PrecisionPolicy.default()
        self.calibration = calibration
        self.answers = answers
        self.limit = largest(self.policy.low) if limit is None else limit

    def call(self, graph_module: GraphModule) -> PassResult:
        graph_module.meta[self.CHECKS_KEY] = []
        calls = calibration_calls(self.program, self.calibration)
        if not calls:
            return PassResult(graph_module, False)
        modules = Facts.of(graph_module).graph_modules
        wide = self.wide_nodes(modules)
        findings = findings_of(modules)
        groups = self.groups(modules, wide, findings)
        dropped: set[Node] = set()
        for label, why in (self.answers or {}).items():
            group = groups.pop(label, None)
            if group is not None and why is not None:
                only_its = droppable(group, findings)
                self.drop(group, only_its, why)
                wide, dropped = wide - only_its, dropped | only_its
        if not groups and not dropped:
            return PassResult(graph_module, False)
        reference = meta.calibration_outputs(graph_module)
        if reference is not None and len(reference) != len(calls):
            reference = None  # calibrated on other inputs
        emulation = Emulation(
            self.program, calls, self.policy.low, reference=reference, cast_down=self.cast_down
        )
        asking = _Asking(graph_module, emulation, wide, dropped, modules)
        for group in sorted(groups.values(), key=lambda g: g.cost, reverse=True):
            self.answer(asking, group, droppable(group, findings))
        orphans = orphaned_chains(findings, asking.wide, asking.dropped)
        if orphans is not None and orphans.label in (self.answers or {}):
            if self.answers[orphans.label] is not None:
                self.drop(orphans, orphans.nodes, self.answers[orphans.label])
        elif orphans is not None:
            self.answer(asking, orphans, orphans.nodes)
        return PassResult(graph_module, False)

    def answer(self, asking: "_Asking", group: Question, droppable: set[Node]) -> None:
        """Measure whether keeping ``droppable`` (``group``'s nodes only it keeps) in
        fp32 lowers the output error; drop the verdict where it does not."""
        names = tuple(sorted(node.name for node in droppable))
        why = None
        if asking.emulation.changes_nothing(asking.wide, droppable):
            why = (
                f"{group.label}: fp32 changes nothing: its consumers compute the same "
                "values either way on the calibration inputs"
            )
            check = Check(group.label, names, None, None, held=False, identical=True)
        elif is_cheap(droppable, asking.cheap_work()):
            check = Check(group.label, names, None, None, held=True, cheap=True)
        else:
            error = asking.error_with()
            without = asking.emulation.error(asking.wide - droppable)
            held = not math.isfinite(without) or without > MEASURABLE * error
            check = Check(group.label, names, error, without, held)
            if not held:
                why = (
                    f"{group.label}: fp32 does not measurably lower the output error on "
                    f"the calibration inputs ({without:.3g} without it, {error:.3g} with it)"
                )
                asking.error = without
        asking.graph_module.meta[self.CHECKS_KEY].append(check)
        if why is not None:
            self.drop(group, droppable, why)
            asking.wide = asking.wide - droppable
            asking.dropped |= droppable
        if self.answers is not None:
            self.answers[group.label] = why

    def cast_down(self, node: Node) -> bool:
        """Whether an op computed in 16-bit reads ``node``, kept fp32, through a cast to
        16-bit (as the planner decides it: kept for a reason that allows it, and carried
        whole by the cast); otherwise the reader computes in fp32 too."""
        rule = fp32_rule(node)
        if rule is not None:
            reason = rule.reason
        elif node.op == "call_function" and self.policy.precision_for(node) == Precision.FP32:
            reason = Reason.POLICY
        else:
            return False  # a region of the model's own: its readers follow it
        low = self.policy.low
        return reason in _DOWNCASTABLE and meta.carried_by_cast(
            node, self.limit, smallest_normal(low)
        )

    def wide_nodes(self, modules: list[GraphModule]) -> set[Node]:
        """The nodes a rule, a kept island or the policy keeps in fp32."""
        wide = set()
        for module in modules:
            members = {
                name for island in live_islands(module) if island.keep for name in island.members
            }
            for node in module.graph.nodes:
                if node.op not in ("placeholder", "call_function"):
                    continue
                kept_island = node.name in members or meta.keeps_island(node)
                by_policy = node.op == "call_function" and (
                    self.policy.precision_for(node) == Precision.FP32
                )
                if fp32_rule(node) is not None or kept_island or by_policy:
                    wide.add(node)
        return wide

    def groups(self, modules, wide: set[Node], findings: list) -> dict[str, Question]:
        """The verdicts to measure, grouped by kind across layers (``findings``: the
        conditioning findings of ``modules``)."""
        total = sum(flops(n) for m in modules for n in m.graph.nodes if is_product(n))
        heavy = max(total * HEAVY_SHARE, 1)
        groups: dict[str, Question] = {}

        def group(label: str, *reasons) -> Question:
            return groups.setdefault(label, Question(label, frozenset(reasons)))

        for module in modules:
            by_name = {n.name: n for n in module.graph.nodes}
            for island in live_islands(module, by_name):
                if not island.keep:
                    continue
                nodes = [by_name[name] for name in island.members if name in by_name]
                cost = sum(flops(n) for n in nodes if is_product(n))
                if cost >= heavy:
                    opening = by_name[island.opening]
                    found = group(f"explicit_fp32 {island.op} at {pattern(opening)}", None)
                    found.nodes.update([opening, *nodes])
                    found.cost += cost
                    found.islands.append((module, opening))
            for node in module.graph.nodes:
                rule = fp32_rule(node)
                checked = rule is not None and rule.reason in _CHECKED_REASONS
                if checked and is_product(node) and flops(node) >= heavy:
                    label = f"{rule.reason.name.lower()} {op_label(node)} at {pattern(node)}"
                    found = group(label, rule.reason)
                    found.nodes.add(node)
                    found.cost += flops(node)
        tolerance = self.policy.resolved_precision_tolerance
        roundoff = torch.finfo(self.policy.low).eps / 2
        for finding in findings:
            if finding.kappa * roundoff < MODERATE * tolerance:
                label = f"ill_conditioned {op_label(finding.seed)} at {pattern(finding.seed)}"
                found = group(label, Reason.ILL_CONDITIONED)
                found.nodes.update(n for n in (finding.seed, *finding.chain) if n in wide)
                found.cost += sum(flops(n) for n in (finding.seed, *finding.chain))
        return groups

    def drop(self, group: Question, nodes: set[Node], why: str) -> None:
        for node in nodes:
            node.meta.pop(Fp32RulesAnalysis.META_KEY, None)
            node.meta.pop(ConditioningAnalysis.META_KEY, None)
            node.meta[self.META_KEY] = why
        for module, opening in group.islands:
            verdict = replace(
                opening.meta[ExplicitFp32Analysis.META_KEY],
                keep=False,
                dtype=self.policy.low,
                why=why,
            )
            opening.meta[ExplicitFp32Analysis.META_KEY] = verdict
            module.meta[ExplicitFp32Analysis.META_KEY] = [
                verdict if island.opening == opening.name else island for island in islands(module)
            ]


@dataclass
class _Asking:
    """What the questions of one run share: the nodes still kept in fp32 (``wide``),
    those dropped so far, the output error with ``wide`` kept and what a cheap
    question's nodes compute at most in ``modules`` (each found when first needed)."""

    graph_module: GraphModule
    emulation: Emulation
    wide: set[Node]
    dropped: set[Node]
    modules: list[GraphModule]
    error: float | None = None
    work: float | None = None

    def cheap_work(self) -> float:
        """What a cheap question's nodes compute at most (found when first needed)."""
        if self.work is None:
            self.work = cheap_work(self.modules)
        return self.work

    def error_with(self) -> float:
        if self.error is None:
            self.error = self.emulation.error(self.wide)
        return self.error


_CHECKED_REASONS = reasons(checked=True)  # declared per reason: REASON_SPECS
_DOWNCASTABLE = reasons(downcastable=True)
