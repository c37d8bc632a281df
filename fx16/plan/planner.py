"""Plan the fp16 cast of one graph: every node's precision, before anything changes.

``plan_fp16(graph_module, policy, limit)`` walks the graph in order, asks each node's
precedence list (``fx16.plan.precedence``) for a ``Choice`` with its inputs read as the plan
so far leaves them, and records what that choice makes of the node (``fx16.plan.steps.Step``):
its decision, its value with the dtypes it will have, whether its consumers read a
16-bit copy (a cast-back, or why none), the scalars it rounds. The bodies of
higher-order ops get plans of their own (``fx16.plan.bodies``).

Reads: what ``fx16.plan.precedence`` reads (the analyses' meta, calibration, the policy) and
the graph. Writes: nothing - the graph, its meta and its bodies are left as they are;
``fx16.passes.fp16_rewrite`` applies the plan.
"""

import operator

import torch
from torch._ops import HigherOrderOperator
from torch.fx import GraphModule, Node

from fx16 import meta
from fx16.analysis.islands import island_decision
from fx16.decisions import Reason, decision, decision_of
from fx16.ops.numeric_tables import GUARDING_OPS
from fx16.ops.numerics import flushes_to_zero, interval_below_normal
from fx16.ops.tables import ASSERT_METADATA_OPS, CAST_OPS, CREATION_OPS, is_custom_op, per_op
from fx16.plan.bodies import plan_autocast, plan_opaque, plan_shared, plan_subgraphs
from fx16.plan.precedence import (
    CAST_TO_FP32_RULES,
    COMPUTE_RULES,
    CREATION_RULES,
    Action,
    Choice,
    choose,
)
from fx16.plan.steps import Plan, Read, Step
from fx16.plan.structural import plan_assertion, plan_getitem, plan_in_place
from fx16.plan.values import follow, guards, narrowed_arguments, scalar_arguments
from fx16.plan.view import View
from fx16.policy import PrecisionPolicy
from fx16.program.aliases import written_in_place
from fx16.program.casts import cast_dtype, is_cast, is_inserted, retype_val
from fx16.program.nodes import (
    dtype_arguments,
    has_fp32_part,
    mutated_argument,
    node_dtype,
    node_val,
)
from fx16.program.propagation import narrowed_result
from fx16.program.subgraphs import AUTOCAST, COND, INVOKE_SUBGRAPH, MAP, SET_GRAD, WHILE_LOOP

FP32 = torch.float32


def plan_fp16(
    graph_module: GraphModule,
    policy: PrecisionPolicy,
    limit: float,
    calibrated: bool = True,
    entries: dict[Node, Read] | None = None,
    shared: dict | None = None,
) -> Plan:
    """The plan of ``graph_module`` (see the module docstring). ``limit``: calibration
    magnitudes above it overflow 16-bit; ``calibrated``: a calibration run reached the
    graph (without one, a value kept fp32 is not cast back: nothing shows it fits);
    ``entries``: a body's placeholders, as its operands feed them; ``shared``: the plans
    of bodies shared by several call sites, by id."""
    return Planner(graph_module, policy, limit, calibrated, entries, shared).run()


@per_op
def role(target) -> str:
    """Which kind of step an op's nodes get (``_STEPS``; each checks the rest)."""
    if target == operator.getitem:
        return "getitem"
    if isinstance(target, HigherOrderOperator):
        if target is AUTOCAST:
            return "autocast"
        if target in (COND, SET_GRAD, WHILE_LOOP, MAP):
            return "subgraphs"
        return "shared" if target is INVOKE_SUBGRAPH else "opaque"
    for kind, ops in (
        ("assert", ASSERT_METADATA_OPS),
        ("cast", CAST_OPS),
        ("creation", CREATION_OPS),
    ):
        if target in ops:
            return kind
    return "op"


class Planner:
    """One planning walk over one graph."""

    def __init__(self, graph_module, policy, limit, calibrated, entries, shared) -> None:
        self.graph_module = graph_module
        self.policy, self.low, self.limit = policy, policy.low, limit
        self.calibrated = calibrated
        self.plan = Plan(graph_module, entries)
        self.plan.low = self.low
        self.shared = {} if shared is None else shared
        self.positions: dict[Node, int] = {}

    def run(self) -> Plan:
        nodes = list(self.graph_module.graph.nodes)
        self.positions = {node: index for index, node in enumerate(nodes)}
        for node in nodes:
            if node.op != "call_function" or is_inserted(node) or decision_of(node) is not None:
                continue  # fx16 decided this node on an earlier run (or made it): keep that
            kind = role(node.target)
            step = _STEPS[kind](self, node)
            if step is not None:
                self.plan.add(node, step)
            elif kind == "assert":
                self.plan.checks.append(node)
        return self.plan

    def op(self, node: Node) -> Step | None:
        return (
            plan_in_place(self, node) if mutated_argument(node) is not None else self.compute(node)
        )

    def cast(self, node: Node) -> Step | None:
        """The model's cast to fp32 (its own list); a copy that keeps the dtype computes
        like an op; a cast to the 16-bit dtype fx16 already gave its value (an autocast
        region's cast of a weight) is a no-op that carries the value's decision, as the
        value itself will once cleanup drops the cast (so casting twice equals once)."""
        if not is_cast(node):
            return None
        dtype = cast_dtype(node)
        if dtype == FP32:
            return self.cast_to_fp32(node)
        if dtype is None:
            return self.compute(node)
        read = self.plan.read(node.args[0], node)
        if read.narrowed and read.dtype == dtype:
            return Step(None, read.decision, node_val(node))
        return None

    def view(self, node: Node) -> View:
        return View(node, self.policy, self.limit, self.plan)

    # ---- ops the precedence lists decide ----------------------------------------------

    def compute(self, node: Node) -> Step:
        view = self.view(node)
        choice = choose(COMPUTE_RULES, view)
        if choice.reason is Reason.MIXED_FLOAT_DTYPES and self._drop_redirects(node):
            # it reads the model's fp32 values after all: a 16-bit source read in their
            # place (a region's opening bypassed) would give it mixed dtypes
            view = self.view(node)
            choice = choose(COMPUTE_RULES, view)
        action, val = choice.action, node_val(node)
        if action == Action.LEAVE:
            made = decision(FP32, choice.reason) if choice.reason is not None else None
            return Step(choice, made, val)
        if action == Action.OPEN_REGION:
            return Step(choice, island_decision(node, FP32), val)
        if action == Action.IN_REGION:
            return Step(choice, decision(FP32, choice.reason, choice.detail), val)
        if action == Action.FP32:
            return self.in_fp32(node, choice, view.produces_fp32)
        if action in (Action.FOLLOW, Action.PROMOTE):
            return follow(self, node, choice, promote=action == Action.PROMOTE)
        if action == Action.WIDEN:
            return follow(self, node, choice, promote=False, widest=FP32)
        if action == Action.LOW:
            return self.in_low(node, choice, view)
        raise _unplanned(choice, node)

    def _drop_redirects(self, node: Node) -> bool:
        """Forget that ``node`` reads a 16-bit source in place of an fp32 cast of it."""
        dropped = [key for key in self.plan.redirects if key[0] is node]
        for key in dropped:
            del self.plan.redirects[key]
        return bool(dropped)

    def cast_to_fp32(self, node: Node) -> Step:
        choice = choose(CAST_TO_FP32_RULES, self.view(node))
        val = node_val(node)
        if choice.action == Action.RETARGET:
            return Step(choice, island_decision(node, self.low), retype_val(val, self.low))
        if choice.action == Action.OPEN_REGION:
            verdict = meta.island_verdict(node)
            members = verdict.members if verdict is not None else frozenset()
            source = self.plan.read(node.args[0], node)
            # they read the 16-bit x, as in the source: where x is in the cast's 16-bit
            # dtype (a bf16 x in an fp16 cast, the model's own, is read widened)
            redirected = [] if source.dtype != self.low else node.users
            for user in redirected:
                if user.name not in members and not _fed_as_exported(user):
                    if decision_of(user) is None:  # one decided on an earlier run keeps
                        self.plan.redirects[(user, node)] = source  # what it reads
            return Step(choice, island_decision(node, FP32), val, region=members)
        if choice.action in (Action.KEEP, Action.FP32):
            return Step(choice, decision(FP32, choice.reason, choice.detail), val)
        raise _unplanned(choice, node)

    def creation(self, node: Node) -> Step | None:
        """A tensor made from scalars (``full``, ``arange``) in fp32: made in 16-bit unless
        a rule keeps it. Its numbers stay as written and the 16-bit kernel rounds what it
        makes to nearest, as eager does (a fill below half the smallest subnormal is
        zero, which the decision's detail says; clamped to the subnormal, it would be
        further from the fp32 value); an infinity-like sentinel is saturated."""
        if node_dtype(node) != FP32:
            return None
        view = self.view(node)
        choice = choose(CREATION_RULES, view)
        if choice.action == Action.LEAVE:
            return Step(choice, decision(FP32, choice.reason, choice.detail), node_val(node))
        if choice.action == Action.FOLLOW:
            return follow(self, node, choice, promote=False)
        if choice.action == Action.FP32:
            return Step(choice, decision(FP32, choice.reason, choice.detail), node_val(node))
        if choice.action != Action.LOW:
            raise _unplanned(choice, node)
        guard = any(user.target in GUARDING_OPS for user in node.users)
        arguments, clamped = scalar_arguments(view, self.low, lambda _, __: guard)
        flushed = [
            (value, 0.0)
            for _, value in view.scalars
            if isinstance(value, float) and not guard and flushes_to_zero(value, self.low)
        ]
        if clamped:
            found = decision(self.low, Reason.SCALAR_CLAMPED, _changes(clamped))
        else:
            found = decision(self.low, choice.reason, _changes(flushed, "flushed to zero: "))
        val = retype_val(node_val(node), self.low)
        return Step(choice, found, val, arguments=tuple(arguments))

    def in_low(self, node: Node, choice: Choice, view: View) -> Step:
        """Computed in 16-bit: its fp32 inputs that may be narrowed are, its float
        scalars kept as eager applies them (a sentinel saturated, a nonzero one below
        the subnormals that the op adds clamped to them: ``scalar_for_16_bit_op``), its
        fp32 dtype arguments made 16-bit."""
        target = node.target
        arguments, clamped = scalar_arguments(
            view, self.low, lambda at, value: guards(target, at, value)
        )
        arguments += [(at, self.low) for at, dtype in dtype_arguments(node) if dtype == FP32]
        narrowed = (
            tuple(a for a in view.fp32_inputs if view.downcastable(a)) if view.fp32_inputs else ()
        )
        val, custom = node_val(node), is_custom_op(node.target)
        if custom or (view.produces_fp32 and not _fp32_tensor(val)):
            values = narrowed_arguments(self, node, narrowed, arguments)
        else:  # the result needs no input: a single fp32 tensor becomes 16-bit, or stays
            values = ()
        result = narrowed_result(node, self.low, view.produces_fp32, *values)
        step = Step(choice, None, result, arguments=tuple(arguments), narrowed_inputs=narrowed)
        if custom and has_fp32_part(result):
            step.decision = decision(FP32, Reason.FIXED_OUTPUT_DTYPE)
            return step
        step.decision = island_decision(node, self.low)
        if step.decision.reason != Reason.FITS:
            return step
        if meta.refuted(node):
            step.decision = decision(self.low, Reason.NOT_WORTH_FP32, meta.refuted(node))
        elif clamped:
            step.decision = decision(self.low, Reason.SCALAR_CLAMPED, _changes(clamped))
        elif choice.detail:
            step.decision = decision(self.low, choice.reason, choice.detail)
        return step

    def in_fp32(self, node: Node, choice: Choice, produces_fp32: bool) -> Step:
        """Computed in fp32 from widened inputs; its consumers read a 16-bit copy where
        the choice allows one and it fits."""
        step = Step(choice, decision(FP32, choice.reason, choice.detail), node_val(node))
        if isinstance(step.val, torch.Tensor) and produces_fp32 and choice.cast_back:
            self.cast_back(node, step, choice.reason)
        return step

    def cast_back(self, node: Node, step: Step, reason: Reason) -> None:
        """Give the consumers of an fp32 result a 16-bit copy, unless it does not fit.

        Casts among the consumers convert anyway, so a node used only by casts gets
        none; nor does one holding an infinity-like sentinel (cast, -1e38 is -inf, not
        the -65504 fx16 saturates it to: a row masked whole would turn nan). A skipped
        cast-back is recorded with its cause."""
        if not self.calibrated:
            step.cast_back_skipped = "no calibration run reached it: nothing shows it fits 16-bit"
        elif meta.overflows(node, self.limit):
            step.cast_back_skipped = f"{meta.observed_said(node)}, beyond 16-bit with the margin"
        elif interval_below_normal((0.0, meta.observed_max_abs(node) or 0.0), self.low):
            seen = meta.observed_max_abs(node)
            step.cast_back_skipped = f"observed at most {seen:.3g}, below 16-bit's normal range"
        elif meta.holds_sentinel(node):
            step.cast_back_skipped = "it holds a -1e38 sentinel, which a 16-bit copy makes -inf"
        elif all(is_cast(user) for user in node.users):
            step.cast_back_skipped = "its consumers are casts, which convert it themselves"
        elif written_in_place(node):
            step.cast_back_skipped = "a write in place reaches it, which a 16-bit copy would miss"
        else:
            step.cast_back = decision(self.low, reason)


def _fed_as_exported(node: Node) -> bool:
    """A higher-order op whose body runs as exported (a disabled autocast region, an op
    fx16 does not look inside): it reads the dtypes it was exported with, its body may
    check them."""
    kind = role(node.target) if node.op == "call_function" else None
    return kind == "opaque" or (kind == "autocast" and not node.args[2])


def _changes(changed: list, prefix: str = "") -> str:
    """``[(1e-12, 5.96e-08)]`` as "1e-12 -> 5.96e-08" for a decision's detail ("": none)."""
    said = ", ".join(f"{value:g} -> {new:.3g}" for value, new in changed)
    return prefix + said if said else ""


def _fp32_tensor(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dtype == FP32


_STEPS = {
    "getitem": plan_getitem,
    "assert": plan_assertion,
    "cast": Planner.cast,
    "creation": Planner.creation,
    "autocast": plan_autocast,
    "subgraphs": plan_subgraphs,
    "shared": plan_shared,
    "opaque": plan_opaque,
    "op": Planner.op,
}


def _unplanned(choice, node: Node) -> AssertionError:
    """A precedence rule chose an action its node's kind has no step for (a bug in a
    rule list, never a property of the program)."""
    return AssertionError(f"rule {choice.rule!r} chose {choice.action} for {node.name}")
