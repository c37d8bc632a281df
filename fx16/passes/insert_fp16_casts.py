"""InsertFP16CastsPass: plan every op's precision (fp16 or fp32), then apply the plan."""

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16.analysis.explicit_fp32 import ExplicitFp32Analysis
from fx16.analysis.facts import Facts
from fx16.analysis.fp32_rules import Fp32RulesAnalysis
from fx16.contracts import require
from fx16.passes.fp16_bodies import apply_autocast, apply_opaque, apply_shared, apply_subgraphs
from fx16.passes.fp16_regions import visit_assert
from fx16.passes.fp16_rewrite import Rewriter
from fx16.passes.policy_pass import PolicyPass
from fx16.plan.planner import plan_fp16, role
from fx16.plan.precedence import Action
from fx16.plan.steps import Plan
from fx16.program.casts import cast_back_source, cast_dtype
from fx16.program.names import kept_output_positions, user_output_positions
from fx16.program.nodes import node_dtype

FP32 = torch.float32

# In force_fp32: keep the program's fp32-computed outputs in fp32.
OUTPUTS = "output"


class InsertFP16CastsPass(PolicyPass):
    """Give every float op a precision (fp16, or the policy's 16-bit dtype; the policy
    can ask for fp32, or to follow the inputs): first the whole graph's plan
    (``plan``: ``fx16.plan.planner``, which asks each node's ordered rule list in
    ``fx16.plan.precedence`` and changes nothing), then one walk that applies it
    (``fx16.passes.fp16_rewrite``; the bodies of higher-order ops in ``fp16_bodies``,
    the model's decomposed fp32 casts in ``fp16_regions``).

    Requires (``requires``, else ``PreconditionError``): Fp32RulesAnalysis and
    ExplicitFp32Analysis have run. Reads: ``meta["val"]`` and ``meta["fx16.precision"]``
    of the inputs (run the parameter and user-input converters first),
    ``meta["fx16.fp32_rule"]``: the safety rules' verdicts (``fx16.analysis.fp32_rules``:
    index, budget, observed overflow, custom ops, conditioning; a pipeline that runs no
    analysis can run ``Fp32RulesAnalysis.needing_nothing``), ``meta["fx16.explicit_fp32"]``:
    which of the model's own fp32 regions stay, and ``meta["fx16.observed_range"]``.
    Writes: op ``meta["val"]`` dtypes, rounded scalars, ``dtype=`` arguments,
    inserted ``_to_copy`` casts (marked ``meta["fx16.inserted"]``) and
    ``meta["fx16.precision"]`` on every op it considers; the output specs.

    An op computes in fp16 when all its float inputs are fp16 and its scalars fit.
    It stays fp32 - fp16 inputs upcast before it, its result cast back after it -
    when an input is fp32 or a scalar lies beyond 65504. Creation ops get
    ``dtype=torch.float16``. A cast to fp32 that the model makes on a 16-bit value
    (``x.float()``), or an op given ``dtype=torch.float32``, that ExplicitFp32Analysis
    keeps opens an fp32 region: ops fed only from it stay fp32 with no cast-back,
    until the model casts to fp32 again (in the source, the cast back to the input
    dtype), which then becomes the cast to fp16. One it does not keep is made
    16-bit. After ``run_decompositions`` those no-op casts are gone and only their
    ``_assert_tensor_metadata(dtype=torch.float32)`` checks remain: the pass reads
    the region from them and inserts the casts the model's own would have been.

    A node a rule keeps in fp32 computes in fp32 from upcast inputs. A value observed
    above ``65504 / overflow_margin`` on calibration inputs is handed on in fp32: no
    cast-back, so its consumers run in fp32 too, until one produces values that fit
    and casts back to fp16. The name ``OUTPUTS`` in ``force_fp32`` returns outputs
    computed in fp32 as fp32.
    Nodes that already carry a decision (from an earlier run) are left as they
    are, so casting twice equals casting once.
    """

    needs = (Fp32RulesAnalysis, ExplicitFp32Analysis)

    def requires(self, graph_module: GraphModule) -> None:
        require(graph_module, type(self).__name__, self.needs)

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        nodes_before = len(graph.nodes)
        plan = self.plan(graph_module)
        run = _Run(graph_module, self.policy, self.limit, plan)
        run.walk()
        if plan.fp32_outputs:
            run.return_fp32_outputs()
        run.restore_output_dtypes(plan.output_dtypes)
        self.program.sync_output_specs()
        modified = run.modified or len(graph.nodes) != nodes_before
        Facts.invalidate(graph_module)
        return PassResult(graph_module, modified)

    def plan(self, graph_module: GraphModule) -> Plan:
        """The plan of ``graph_module``, which this pass applies: every op's step, the
        bodies' plans, the dtypes outputs keep (mutated buffers and inputs, outputs kept
        by ``keep_io_types``) and whether outputs computed in fp32 return in fp32 (print
        it with ``str``). Changes nothing."""
        self.requires(graph_module)
        plan = plan_fp16(graph_module, self.policy, self.limit)
        returned = graph_module.graph.output_node().args[0]
        kept = {
            index: node_dtype(returned[index])
            for index in self.kept_output_positions()
            if isinstance(returned[index], Node)
        }
        plan.output_dtypes = {**kept, **self.program.required_output_dtypes()}
        plan.fp32_outputs = OUTPUTS in self.force_fp32
        return plan

    def kept_output_positions(self) -> set[int]:
        """The output positions ``keep_io_types`` keeps at their dtypes."""
        kept = self.policy.keep_io_types
        if kept is True:
            return set(user_output_positions(self.program))
        return kept_output_positions(self.program, kept) if kept else set()


class _Run(Rewriter):
    """One walk over one graph, applying its plan: each node's step (``fx16.plan.steps``)."""

    def __init__(self, *rewriter, root: GraphModule | None = None) -> None:
        """``rewriter``: ``Rewriter``'s arguments; ``root``: the program's graph module
        when this walk is in a body (it recompiles the body, and the root is left to the
        pipeline)."""
        super().__init__(*rewriter)
        self.root = root or self.graph_module

    def walk(self) -> None:
        for node, step in list(self.plan.steps.items()):
            kind = role(node.target)
            if kind == "assert":
                visit_assert(self, node, step)
            else:
                self.apply(node, kind, step)
        for check in self.plan.checks:  # after the steps: the values they check are final
            visit_assert(self, check, None)
        if self.modified and self.graph_module is not self.root:
            # a subgraph's code must match before its HOP runs (the root is recompiled
            # once, by whoever runs the pipeline)
            self.graph_module.recompile()

    def apply_body(self, body: GraphModule, plan) -> "_Run":
        """Apply a higher-order op's body's plan."""
        inner = _Run(body, self.policy, self.limit, plan, root=self.root)
        inner.walk()
        return inner

    def apply(self, node: Node, kind: str, step) -> None:
        if kind == "autocast" and node.args[2]:
            apply_autocast(self, node, step)
        elif kind == "subgraphs":
            apply_subgraphs(self, node, step)
        elif kind == "shared":
            apply_shared(self, node, step)
        elif kind in ("autocast", "opaque"):
            apply_opaque(self, node, step)
        elif kind == "getitem":
            self.record(node, step)
            self.cast_back(node, step)
        elif step.choice is None:  # an in-place op
            self.record(node, step)
        elif kind == "cast" and cast_dtype(node) == FP32:
            self.apply_cast_to_fp32(node, step)
        elif kind == "creation":
            self.apply_creation(node, step)
        else:
            self.apply_compute(node, step)

    def apply_compute(self, node: Node, step) -> None:
        action = step.choice.action
        if action == Action.FP32:
            self.run_in_fp32(node, step)
        elif action in (Action.FOLLOW, Action.PROMOTE, Action.WIDEN):
            self.follow(node, step)
        elif action == Action.LOW:
            self.run_in_low(node, step)
        else:  # LEAVE, OPEN_REGION, IN_REGION: the decision only
            self.record(node, step)

    def apply_cast_to_fp32(self, node: Node, step) -> None:
        if step.choice.action == Action.RETARGET:
            self.retarget(node, step)
            return
        self.record(node, step)
        if step.region is not None:  # export routes later uses of x through x.float()
            source = node.args[0]  # x, or the 16-bit copy of an fp32 x fx16 cast back
            original = cast_back_source(source, FP32) or source
            for user in list(node.users):
                read = self.plan.redirects.get((user, node))
                if read is not None and read.name == original.name:  # they read the 16-bit x
                    user.replace_input_with(node, source)
                    self.modified = True

    def apply_creation(self, node: Node, step) -> None:
        action = step.choice.action
        if action == Action.FOLLOW:
            self.follow(node, step)
        elif action == Action.LEAVE:  # fp32 as the model makes it
            self.record(node, step)
        else:  # *_like and new_* ops follow their input's dtype, which may be 16-bit now
            self.creation(node, step, FP32 if action == Action.FP32 else self.low)
