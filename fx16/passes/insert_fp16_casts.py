"""InsertFP16CastsPass: decide, op by op, whether to compute in fp16 or fp32."""

import operator

import torch
from torch._ops import HigherOrderOperator
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16.analysis.explicit_fp32 import ExplicitFp32Analysis, outside_island
from fx16.analysis.fp32_rules import Fp32RulesAnalysis
from fx16.casts import cast_dtype, is_cast, is_inserted, retype_val
from fx16.contracts import require
from fx16.decisions import Reason, decide, decision_of, was_narrowed
from fx16.facts import Facts
from fx16.islands import is_island
from fx16.names import kept_output_positions, user_output_positions
from fx16.nodes import FLOAT_DTYPES, mutated_argument, node_dtype, node_val, set_argument
from fx16.numerics import round_scalar_to_fp16
from fx16.ops import ASSERT_METADATA_OPS, CAST_OPS, CREATION_OPS, per_op
from fx16.passes.fp16_bodies import (
    visit_autocast_region,
    visit_opaque,
    visit_shared_body,
    visit_subgraphs,
)
from fx16.passes.fp16_regions import visit_assert
from fx16.passes.fp16_rewrite import Rewriter, decide_island
from fx16.passes.policy_pass import PolicyPass
from fx16.precedence import (
    CAST_TO_FP32_RULES,
    COMPUTE_RULES,
    CREATION_RULES,
    Action,
    choose,
)
from fx16.subgraphs import AUTOCAST, COND, INVOKE_SUBGRAPH, MAP, SET_GRAD, WHILE_LOOP

FP32 = torch.float32

# In force_fp32: keep the program's fp32-computed outputs in fp32.
OUTPUTS = "output"


class InsertFP16CastsPass(PolicyPass):
    """Walk the graph in order and give every float op a precision (fp16, or the
    policy's 16-bit dtype; the policy can ask for fp32, or to follow the inputs).

    Each node's precision is chosen first (``fx16.precedence``: one ordered rule list
    per node kind, reading only) and then applied (``fx16.passes.fp16_rewrite``; the
    bodies of higher-order ops in ``fp16_bodies``, the model's decomposed fp32 casts
    in ``fp16_regions``).

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
        returned = graph.output_node().args[0]
        kept_outputs = {
            index: node_dtype(returned[index])
            for index in self.kept_output_positions()
            if isinstance(returned[index], Node)
        }
        run = _Run(graph_module, self.policy, self.limit)
        run.walk()
        if OUTPUTS in self.force_fp32:
            run.return_fp32_outputs()
        run.restore_output_dtypes({**kept_outputs, **self.program.required_output_dtypes()})
        self.program.sync_output_specs()
        modified = run.modified or len(graph.nodes) != nodes_before
        Facts.invalidate(graph_module)
        return PassResult(graph_module, modified)

    def kept_output_positions(self) -> set[int]:
        """The output positions ``keep_io_types`` keeps at their dtypes."""
        kept = self.policy.keep_io_types
        if kept is True:
            return set(user_output_positions(self.program))
        return kept_output_positions(self.program, kept) if kept else set()


@per_op
def _role(target) -> str:
    """Which ``visit_*`` an op's nodes get (``_Run.visit`` checks the rest)."""
    if target == operator.getitem:
        return "getitem"
    if isinstance(target, HigherOrderOperator):
        if target is AUTOCAST:
            return "autocast"
        if target in (COND, SET_GRAD, WHILE_LOOP, MAP):
            return "subgraphs"
        return "shared" if target is INVOKE_SUBGRAPH else "opaque"
    for role, ops in (
        ("assert", ASSERT_METADATA_OPS),
        ("cast", CAST_OPS),
        ("creation", CREATION_OPS),
    ):
        if target in ops:
            return role
    return "op"


class _Run(Rewriter):
    """One walk over one graph: each node's choice (``fx16.precedence``), then its edit."""

    def __init__(self, *rewriter, root: GraphModule | None = None) -> None:
        """``rewriter``: ``Rewriter``'s arguments; ``root``: the program's graph module
        when this walk is in a body (it recompiles the body, and the root is left to the
        pipeline)."""
        super().__init__(*rewriter)
        self.root = root or self.graph_module
        self.nodes: list[Node] = []
        self.positions: dict[Node, int] | None = None  # built on first need

    def walk(self) -> None:
        self.nodes = list(self.graph_module.graph.nodes)
        for node in self.nodes:
            if node.op == "call_function":
                self.visit(node)
        if self.modified and self.graph_module is not self.root:
            # a subgraph's code must match before its HOP runs (the root is recompiled
            # once, by whoever runs the pipeline)
            self.graph_module.recompile()

    def walk_body(self, body: GraphModule, calibrated: bool) -> "_Run":
        """Walk a higher-order op's body (``calibrated``: a calibration run reached it)."""
        inner = _Run(body, self.policy, self.limit, calibrated, root=self.root)
        inner.walk()
        return inner

    def later_users(self, value: Node, anchor: Node) -> list[Node]:
        """The users of ``value`` that come after ``anchor`` in the graph as the walk
        found it (nodes inserted since then are left alone)."""
        if self.positions is None:
            self.positions = {node: index for index, node in enumerate(self.nodes)}
        after = self.positions[anchor]
        return [user for user in value.users if self.positions.get(user, -1) > after]

    def visit(self, node: Node) -> None:
        if is_inserted(node) or decision_of(node) is not None:
            return  # fx16 decided this node on an earlier run (or made it): keep that
        role = _role(node.target)
        if role == "getitem":
            self.visit_getitem(node)
        elif role == "assert":
            visit_assert(self, node)
        elif role == "cast" and is_cast(node):
            if cast_dtype(node) == FP32:
                self.visit_cast_to_fp32(node)
            elif cast_dtype(node) is None:  # a copy that keeps the dtype computes like an op
                self.visit_compute(node)
        elif role == "creation" and node_dtype(node) == FP32:
            self.visit_creation(node)
        elif role == "autocast" and node.args[2]:
            visit_autocast_region(self, node)
        elif role == "subgraphs":
            visit_subgraphs(self, node)
        elif role == "shared":
            visit_shared_body(self, node)
        elif role in ("autocast", "opaque"):  # a disabled autocast region runs as it is
            visit_opaque(self, node)
        elif mutated_argument(node) is not None:
            self.visit_in_place(node)
        else:
            self.visit_compute(node)

    def visit_compute(self, node: Node) -> None:
        view = self.view(node)
        choice = choose(COMPUTE_RULES, view)
        action = choice.action
        if action == Action.LEAVE:
            if choice.reason is not None:
                decide(node, FP32, choice.reason)
        elif action == Action.OPEN_REGION:
            decide_island(node, FP32)
        elif action == Action.IN_REGION:
            decide(node, FP32, choice.reason, detail=choice.detail)
        elif action == Action.FP32:
            self.run_in_fp32(node, choice, view.produces_fp32)
        elif action in (Action.FOLLOW, Action.PROMOTE):
            self.follow(node, choice, promote=action == Action.PROMOTE)
        else:
            self.run_in_low(node, choice, view)

    def visit_cast_to_fp32(self, node: Node) -> None:
        choice = choose(CAST_TO_FP32_RULES, self.view(node))
        action = choice.action
        if action == Action.RETARGET:
            self.retarget(node, self.low)
        elif action == Action.OPEN_REGION:
            decide_island(node, FP32)
            for user in outside_island(node):  # export routes later uses of x through x.float()
                user.replace_input_with(node, node.args[0])
                self.modified = True
        else:  # FP32 or KEEP: the cast stays, with the reason
            decide(node, FP32, choice.reason, detail=choice.detail)

    def visit_creation(self, node: Node) -> None:
        view = self.view(node)
        choice = choose(CREATION_RULES, view)
        if choice.action == Action.LEAVE:
            return
        if choice.action == Action.FOLLOW:
            self.follow(node, choice, promote=False)
            return
        if choice.action == Action.FP32:
            # *_like and new_* ops follow their input's dtype, which may be fp16 by now
            if node.kwargs.get("dtype") != FP32:
                node.kwargs = {**node.kwargs, "dtype": FP32}
                self.modified = True
            decide(node, FP32, choice.reason, detail=choice.detail)
            return
        for location, value in view.scalars:
            if isinstance(value, float):
                set_argument(node, location, round_scalar_to_fp16(value, self.low))
        node.kwargs = {**node.kwargs, "dtype": self.low}
        node.meta["val"] = retype_val(node.meta["val"], self.low)
        decide(node, self.low, Reason.FITS)
        self.modified = True

    def visit_getitem(self, node: Node) -> None:
        container, index = node.args
        container_val = node_val(container)
        if not isinstance(container_val, (list, tuple)):
            return
        element = container_val[index]
        if not isinstance(element, torch.Tensor):
            return
        original = node_dtype(node)
        node.meta["val"] = element
        decision = decision_of(container)
        if decision is None:
            return
        dtype = element.dtype if element.dtype in FLOAT_DTYPES else decision.dtype
        decide(node, dtype, decision.reason, detail=decision.detail)
        if original == FP32 and element.dtype == FP32 and not is_island(node):
            self.cast_back(node, decision.reason)

    def visit_in_place(self, node: Node) -> None:
        """An in-place op keeps the dtype of the tensor it writes to, and its decision:
        consumers of a cache written in place read it as the 16-bit tensor it now is."""
        written = mutated_argument(node)
        target_dtype = node_dtype(written)
        val = node_val(node)
        if isinstance(val, torch.Tensor) and target_dtype is not None and val.dtype != target_dtype:
            node.meta["val"] = retype_val(val, target_dtype)
            self.modified = True
        if was_narrowed(written):
            self.inherit(node, written)
