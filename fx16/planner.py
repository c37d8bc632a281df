"""Plan the fp16 cast of one graph: every node's precision, before anything changes.

``plan_fp16(graph_module, policy, limit)`` walks the graph in order, asks each node's
precedence list (``fx16.precedence``) for a ``Choice`` with its inputs read as the plan
so far leaves them, and records what that choice makes of the node (``fx16.plan.Step``):
its decision, its value with the dtypes it will have, whether its consumers read a
16-bit copy (a cast-back, or why none), the scalars it rounds. The bodies of
higher-order ops get plans of their own (``fx16.plan_bodies``).

Reads: what ``fx16.precedence`` reads (the analyses' meta, calibration, the policy) and
the graph. Writes: nothing - the graph, its meta and its bodies are left as they are;
``fx16.passes.fp16_rewrite`` applies the plan.
"""

import operator

import torch
from torch._ops import HigherOrderOperator
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from fx16 import meta
from fx16.casts import cast_dtype, is_cast, is_inserted, retype_val
from fx16.decisions import Reason, decision, decision_of
from fx16.islands import island_decision
from fx16.nodes import (
    FLOAT_DTYPES,
    dtype_arguments,
    float_rank,
    has_fp32_part,
    mutated_argument,
    node_dtype,
    node_val,
    tensor_inputs,
    tensor_leaves,
    value_scalars,
)
from fx16.numerics import round_scalar_to_fp16, smallest_subnormal
from fx16.ops import ASSERT_METADATA_OPS, CAST_OPS, CREATION_OPS, is_custom_op, per_op
from fx16.plan import Plan, Read, Step
from fx16.plan_bodies import plan_autocast, plan_opaque, plan_shared, plan_subgraphs
from fx16.plan_structural import plan_assertion, plan_getitem, plan_in_place
from fx16.policy import PrecisionPolicy
from fx16.precedence import (
    CAST_TO_FP32_RULES,
    COMPUTE_RULES,
    CREATION_RULES,
    Action,
    Choice,
    View,
    choose,
)
from fx16.propagation import narrowed_result, output_dtypes_by_running, propagate_fake
from fx16.subgraphs import AUTOCAST, COND, INVOKE_SUBGRAPH, MAP, SET_GRAD, WHILE_LOOP

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
    """Which kind of step an op's nodes get (``Planner.step`` checks the rest)."""
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
        structural = {
            "autocast": plan_autocast,
            "subgraphs": plan_subgraphs,
            "shared": plan_shared,
            "opaque": plan_opaque,
        }
        nodes = list(self.graph_module.graph.nodes)
        self.positions = {node: index for index, node in enumerate(nodes)}
        for node in nodes:
            if node.op != "call_function" or is_inserted(node) or decision_of(node) is not None:
                continue  # fx16 decided this node on an earlier run (or made it): keep that
            kind = role(node.target)
            if kind == "autocast" and not node.args[2]:
                kind = "opaque"  # a disabled autocast region runs as it is
            if kind in structural:
                step = structural[kind](self, node)
            else:
                step = self.step(node, kind)
            if step is not None:
                self.plan.add(node, step)
        return self.plan

    def step(self, node: Node, kind: str) -> Step | None:
        if kind == "getitem":
            return plan_getitem(self, node)
        if kind == "assert":
            return plan_assertion(self, node)
        if kind == "cast" and is_cast(node):
            if cast_dtype(node) == FP32:
                return self.cast_to_fp32(node)
            return self.compute(node) if cast_dtype(node) is None else None
        if kind == "creation":
            return self.creation(node) if node_dtype(node) == FP32 else None
        if kind == "cast":
            return None
        if mutated_argument(node) is not None:
            return plan_in_place(self, node)
        return self.compute(node)

    def view(self, node: Node) -> View:
        return View(node, self.policy, self.limit, self.plan)

    # ---- ops the precedence lists decide ----------------------------------------------

    def compute(self, node: Node) -> Step:
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
            return self.follow(node, choice, promote=action == Action.PROMOTE)
        return self.in_low(node, choice, view)

    def cast_to_fp32(self, node: Node) -> Step:
        choice = choose(CAST_TO_FP32_RULES, self.view(node))
        val = node_val(node)
        if choice.action == Action.RETARGET:
            return Step(choice, island_decision(node, self.low), retype_val(val, self.low))
        if choice.action == Action.OPEN_REGION:
            verdict = meta.island_verdict(node)
            members = verdict.members if verdict is not None else frozenset()
            source = self.plan.read(node.args[0], node)
            for user in node.users:  # they read the 16-bit x, as in the source
                if user.name not in members:
                    self.plan.redirects[(user, node)] = source
            return Step(choice, island_decision(node, FP32), val, region=members)
        return Step(choice, decision(FP32, choice.reason, choice.detail), val)

    def creation(self, node: Node) -> Step | None:
        view = self.view(node)
        choice = choose(CREATION_RULES, view)
        if choice.action == Action.LEAVE:
            return None
        if choice.action == Action.FOLLOW:
            return self.follow(node, choice, promote=False)
        if choice.action == Action.FP32:
            return Step(choice, decision(FP32, choice.reason, choice.detail), node_val(node))
        scalars = tuple(
            (location, round_scalar_to_fp16(value, self.low))
            for location, value in view.scalars
            if isinstance(value, float)
        )
        val = retype_val(node_val(node), self.low)
        return Step(choice, decision(self.low, Reason.FITS), val, scalars=scalars)

    def in_low(self, node: Node, choice: Choice, view: View) -> Step:
        """Computed in 16-bit: its fp32 inputs that may be narrowed are, its float
        scalars rounded (a nonzero one below the subnormals clamped to them), its fp32
        dtype arguments made 16-bit."""
        scalars, clamped = [], []
        for location, value in view.scalars:
            rounded = round_scalar_to_fp16(value, self.low) if isinstance(value, float) else value
            if rounded != value:
                scalars.append((location, rounded))
                if value and abs(value) < smallest_subnormal(self.low):
                    clamped.append((value, rounded))
        val = node_val(node)
        if is_custom_op(node.target) or (view.produces_fp32 and not _fp32_tensor(val)):
            arguments = self.narrowed_arguments(node, view, scalars)
        else:  # the result needs no input: a single fp32 tensor becomes 16-bit, or stays
            arguments = ()
        result = narrowed_result(node, self.low, view.produces_fp32, *arguments)
        step = Step(choice, None, result, scalars=tuple(scalars))
        if is_custom_op(node.target) and has_fp32_part(result):
            step.decision = decision(FP32, Reason.FIXED_OUTPUT_DTYPE)
            return step
        step.decision = island_decision(node, self.low)
        if step.decision.reason != Reason.FITS:
            return step
        if meta.refuted(node):
            step.decision = decision(self.low, Reason.NOT_WORTH_FP32, meta.refuted(node))
        elif clamped:
            said = ", ".join(f"{value:g} -> {new:.3g}" for value, new in clamped)
            step.decision = decision(self.low, Reason.SCALAR_CLAMPED, said)
        elif choice.detail:
            step.decision = decision(self.low, Reason.FITS, choice.detail)
        return step

    def narrowed_arguments(self, node: Node, view: View, scalars: list) -> tuple:
        """The arguments ``node`` runs on in 16-bit, as values: inputs as read (fp32 ones
        that may be narrowed in 16-bit), rounded scalars, 16-bit dtype arguments."""

        def value(arg: Node):
            read = self.plan.read(arg, node)
            if read.dtype == FP32 and view.downcastable(arg):
                return retype_val(read.val, self.low)
            return read.val

        args, kwargs = list(map_arg(node.args, value)), dict(map_arg(node.kwargs, value))
        changed = scalars + [
            (location, self.low) for location, dtype in dtype_arguments(node) if dtype == FP32
        ]
        for (kind, key), new in changed:
            if kind == "args":
                args[key] = new
            else:
                kwargs[key] = new
        return tuple(args), kwargs

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
        none. A skipped cast-back is recorded with its cause."""
        if not self.calibrated:
            step.cast_back_skipped = "no calibration run reached it: nothing shows it fits 16-bit"
        elif meta.overflows(node, self.limit):
            limit = meta.observed_max_abs(node)
            step.cast_back_skipped = f"observed {limit:.4g}, beyond 16-bit with the margin"
        elif all(is_cast(user) for user in node.users):
            step.cast_back_skipped = "its consumers are casts, which convert it themselves"
        else:
            step.cast_back = decision(self.low, reason)

    def follow(self, node: Node, choice: Choice, promote: bool) -> Step:
        """Computed in the dtype its inputs give it (``promote``: their widest first)."""
        reads = {arg: self.plan.read(arg, node) for arg in tensor_inputs(node)}
        widest = None
        if promote:
            floats = [read.dtype for read in reads.values() if read.dtype in FLOAT_DTYPES]
            widest = max(floats, key=float_rank, default=None)
            reads = {
                arg: Read(retype_val(read.val, widest), None, arg.name)
                if read.dtype in FLOAT_DTYPES and read.dtype != widest
                else read
                for arg, read in reads.items()
            }
        input_dtypes = {read.dtype for read in reads.values() if read.dtype in FLOAT_DTYPES}

        def value(arg: Node):
            return reads[arg].val if arg in reads else self.plan.read(arg, node).val

        args, kwargs = map_arg(node.args, value), map_arg(node.kwargs, value)
        try:
            result = propagate_fake(node, args, kwargs)
            if len(input_dtypes) > 1:  # mixed float inputs: trust a real kernel, not the meta one
                result = output_dtypes_by_running(node, result, args, kwargs)
        except RuntimeError:
            if promote or len(input_dtypes) < 2:
                raise
            # the op cannot mix float dtypes (a convolution with bf16 input, fp32 weight):
            # it runs in the widest of them
            return self.follow(node, choice, promote=True)
        dtypes = {leaf.dtype for leaf in tensor_leaves(result) if leaf.is_floating_point()}
        scalar_overflow = any(
            round_scalar_to_fp16(float(v), self.low) is None for _, v in value_scalars(node)
        )
        if self.low in dtypes and scalar_overflow:  # safety first: the scalar needs fp32
            fp32 = Choice(Action.FP32, Reason.SCALAR_OVERFLOW, cast_back=self.policy.cast_back)
            step = self.in_fp32(node, fp32, True)
        else:
            dtype = self.low if self.low in dtypes else FP32
            step = Step(choice, decision(dtype, Reason.POLICY_FOLLOW, choice.detail), result)
        step.widest = widest
        return step


def _fp32_tensor(val) -> bool:
    return isinstance(val, torch.Tensor) and val.dtype == FP32
