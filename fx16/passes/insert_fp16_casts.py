"""InsertFP16CastsPass: decide, op by op, whether to compute in fp16 or fp32."""

import operator

import torch
from torch._ops import HigherOrderOperator
from torch.fx import GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.infra.pass_base import PassResult

from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.explicit_fp32 import (
    ExplicitFp32Analysis,
    decide_island,
    island_readers,
    island_verdict,
    keeps_island,
    outside_island,
)
from fx16.analysis.fp32_rules import Fp32RulesAnalysis, fp32_rule
from fx16.analysis.verdict_check import VerdictCheckAnalysis
from fx16.casts import (
    INSERTED,
    WHY_CAST_BACK,
    WHY_NARROW,
    WHY_OUTPUT_DTYPE,
    WHY_RETARGETED,
    WHY_UPCAST,
    CastInserter,
    cast_back_source,
    cast_dtype,
    is_cast,
    is_inserted,
    retype_val,
    set_cast_dtype,
    substitute_inputs,
)
from fx16.decisions import PRECISION, Reason, decide, decision_of, was_narrowed
from fx16.islands import asserted_dtype, is_island
from fx16.names import kept_output_positions, user_output_positions
from fx16.nodes import (
    FLOAT_DTYPES,
    dtype_arguments,
    float_rank,
    has_fp32_part,
    mutated_argument,
    node_dtype,
    node_val,
    requested_dtypes,
    set_argument,
    tensor_inputs,
    tensor_leaves,
    value_scalars,
)
from fx16.numerics import round_scalar_to_fp16, smallest_subnormal
from fx16.ops import (
    ASSERT_METADATA_OPS,
    CREATION_OPS,
    is_custom_op,
)
from fx16.passes.policy_pass import PolicyPass
from fx16.policy import Precision, PrecisionPolicy
from fx16.propagation import (
    narrowed_result,
    output_dtypes_by_running,
    propagate_fake,
)
from fx16.subgraphs import (
    AUTOCAST,
    COND,
    INVOKE_SUBGRAPH,
    MAP,
    SET_GRAD,
    WHILE_LOOP,
    bodies_and_operands,
    carried_count,
)

FP32 = torch.float32

# In force_fp32: keep the program's fp32-computed outputs in fp32.
OUTPUTS = "output"


class InsertFP16CastsPass(PolicyPass):
    """Walk the graph in order and give every float op a precision (fp16, or the
    policy's 16-bit dtype; the policy can ask for fp32, or to follow the inputs).

    Reads: ``meta["val"]`` and ``meta["fx16.precision"]`` of the inputs (run the
    parameter and user-input converters first), ``meta["fx16.fp32_rule"]``: the
    safety rules' verdicts (``fx16.analysis.fp32_rules``: index, budget, observed
    overflow, custom ops, conditioning; the pass runs the standard rules itself
    when no Fp32RulesAnalysis ran), ``meta["fx16.explicit_fp32"]``: which of the
    model's own fp32 regions stay (``fx16.analysis.explicit_fp32``, run by the pass
    itself when it has not run), and ``meta["fx16.observed_range"]``.
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

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        nodes_before = len(graph.nodes)
        returned = graph.output_node().args[0]
        kept_outputs = {
            index: node_dtype(returned[index])
            for index in self.kept_output_positions()
            if isinstance(returned[index], Node)
        }
        if Fp32RulesAnalysis.RAN_KEY not in graph_module.meta:  # used on its own
            rules = Fp32RulesAnalysis.standard(self.policy.low, self.limit, self.force_fp32)
            rules.call(graph_module)  # on whatever facts the graph holds
        if ExplicitFp32Analysis.META_KEY not in graph_module.meta:  # used on its own
            ExplicitFp32Analysis(self.program, self.policy, self.overflow_margin)(graph_module)
        run = _Run(
            graph_module,
            self.policy,
            self.limit,
        )
        run.walk()
        if OUTPUTS in self.force_fp32:
            run.return_fp32_outputs()
        run.restore_output_dtypes({**kept_outputs, **self.program.required_output_dtypes()})
        self.program.sync_output_specs()
        modified = run.modified or len(graph.nodes) != nodes_before
        return PassResult(graph_module, modified)

    def kept_output_positions(self) -> set[int]:
        """The output positions ``keep_io_types`` keeps at their dtypes."""
        kept = self.policy.keep_io_types
        if kept is True:
            return set(user_output_positions(self.program))
        return kept_output_positions(self.program, kept) if kept else set()


# Reasons an fp32 value may have that still let a 16-bit op read it through a cast.
_DOWNCASTABLE = frozenset(
    {
        Reason.POLICY,
        Reason.POLICY_FOLLOW,
        Reason.ACCURACY_FALLBACK,
        Reason.LOOP_CARRIED,
        Reason.FIXED_OUTPUT_DTYPE,
        Reason.ILL_CONDITIONED,
        Reason.UNDERFLOW,
    }
)


def _unify_outputs(submodules: list[GraphModule]) -> list[Node]:
    """Make every body return the same dtype per output (fp32 where they disagree).

    Returns the first body's output nodes."""
    outputs = [list(sub.graph.output_node().args[0]) for sub in submodules]
    for index, candidates in enumerate(zip(*outputs)):
        if len({node_dtype(candidate) for candidate in candidates}) < 2:
            continue
        for submodule, values in zip(submodules, outputs):
            value = values[index]
            if node_dtype(value) != FP32:
                values[index] = CastInserter(submodule.graph).cast(value, FP32, WHY_UPCAST)
        for submodule, values in zip(submodules, outputs):
            output = submodule.graph.output_node()
            output.args = (type(output.args[0])(values), *output.args[1:])
            submodule.recompile()
    return outputs[0]


class _Run:
    """State of one walk over one graph."""

    def __init__(
        self,
        graph_module: GraphModule,
        policy: PrecisionPolicy,
        limit: float,
        calibrated: bool = True,
        root: GraphModule | None = None,
    ) -> None:
        self.graph_module = graph_module
        self.root = root or graph_module
        self.casts = CastInserter(graph_module.graph)
        self.policy = policy
        self.low = policy.low
        self.limit = limit
        # Without observations (a cond branch calibration did not take) a value forced to
        # fp32 stays fp32 (no cast-back): nothing shows that it fits fp16 again.
        self.calibrated = calibrated
        self.modified = False
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

    def overflows(self, node: Node) -> bool:
        """Calibration saw this node hold values too large for fp16."""
        return node.meta.get(CalibrationAnalysis.META_KEY, 0.0) > self.limit

    def forced(self, node: Node) -> Reason | None:
        """Why ``node`` must stay fp32 whatever its inputs, as Fp32RulesAnalysis found."""
        rule = fp32_rule(node)
        return rule.reason if rule is not None else None

    def visit(self, node: Node) -> None:
        if is_inserted(node) or decision_of(node) is not None:
            return  # fx16 decided this node on an earlier run (or made it): keep that
        if node.target == operator.getitem:
            self.visit_getitem(node)
        elif node.target in ASSERT_METADATA_OPS:
            self.visit_assert(node)
        elif is_cast(node) and cast_dtype(node) == FP32:
            self.visit_cast_to_fp32(node)
        elif is_cast(node):
            self.visit_other_cast(node)
        elif node.target in CREATION_OPS and node_dtype(node) == FP32:
            self.visit_creation(node)
        elif node.target is AUTOCAST and node.args[2]:
            self.visit_autocast_region(node)
        elif node.target in (COND, SET_GRAD, WHILE_LOOP, MAP):
            self.visit_subgraphs(node)
        elif node.target is INVOKE_SUBGRAPH:
            self.visit_shared_body(node)
        elif isinstance(node.target, HigherOrderOperator):
            self.visit_opaque(node)
        elif mutated_argument(node) is not None:
            self.visit_in_place(node)
        else:
            self.visit_compute(node)

    # ---- special nodes -------------------------------------------------------------

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
        decide(
            node,
            element.dtype if element.dtype in FLOAT_DTYPES else decision.dtype,
            decision.reason,
        )
        if original == FP32 and element.dtype == FP32 and not is_island(node):
            self.cast_back(node, decision.reason)

    def visit_assert(self, node: Node) -> None:
        """``_assert_tensor_metadata`` checks the dtype of the value as it is now.

        After ``run_decompositions`` the assertion is all that is left of a model's
        ``x.float()`` on a value that was fp32 at export (the cast itself was a no-op),
        so an assertion of fp32 with no cast after it marks the model's fp32 region,
        as the cast would."""
        if asserted_dtype(node) == FP32 and isinstance(node.args[0], Node):
            self.restore_explicit_cast(node)
        dtype = node_dtype(node.args[0])
        if dtype is None:
            return
        if len(node.args) > 3 and isinstance(node.args[3], torch.dtype):
            if node.args[3] != dtype:
                set_argument(node, ("args", 3), dtype)
                self.modified = True
            # torch.export.load may also leave a copy in kwargs; two dtypes break the call.
            if "dtype" in node.kwargs:
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
        elif isinstance(node.kwargs.get("dtype"), torch.dtype) and node.kwargs["dtype"] != dtype:
            set_argument(node, ("kwargs", "dtype"), dtype)
            self.modified = True

    def restore_explicit_cast(self, assertion: Node) -> None:
        """Put back, after ``assertion``, the model's fp32 cast that decomposition
        dropped, when fx16's decisions make it matter: it opens an fp32 region of a
        16-bit value that ExplicitFp32Analysis keeps, or (``_is_island``) is the way
        back from one. The ops of the island read the opening cast; every consumer
        after the assertion reads the way back."""
        value = assertion.args[0]
        dtype = node_dtype(value)
        opens = dtype == self.low and keeps_island(assertion)
        closes = dtype == FP32 and is_island(value) and self.policy.cast_back
        later = self.later_users(value, assertion)
        if not (opens or closes) or not later or any(is_cast(user) for user in later):
            return  # nothing to do, or the cast is still there (not decomposed, or cast before)
        if any(decision_of(user) is not None for user in later):
            return  # decided on an earlier run: casting twice equals casting once
        cast = self.casts.cast_placed_after(
            assertion,
            value,
            FP32 if opens else self.low,
            WHY_UPCAST if opens else WHY_CAST_BACK,
        )
        for user in island_readers(assertion, later) if opens else later:
            user.replace_input_with(value, cast)
        if opens:
            decide(cast, FP32, Reason.EXPLICIT_FP32, detail=island_verdict(assertion).why)
        else:
            decide(cast, self.low, Reason.FITS)
        self.modified = True

    def later_users(self, value: Node, anchor: Node) -> list[Node]:
        """The users of ``value`` that come after ``anchor`` in the graph as the walk
        found it (nodes inserted since then are left alone)."""
        if self.positions is None:
            self.positions = {node: index for index, node in enumerate(self.nodes)}
        after = self.positions[anchor]
        return [user for user in value.users if self.positions.get(user, -1) > after]

    def visit_cast_to_fp32(self, node: Node) -> None:
        source = node.args[0]
        source_dtype = node_dtype(source)
        if self.forced(node):
            self.decide_fp32(node, self.forced(node))
        elif source_dtype == FP32 and is_island(source) and self.policy.cast_back:
            # The model's way back from its fp32 region: to the program's working dtype.
            self.retarget(node, self.low)
        elif source_dtype == FP32:
            decide(
                node, FP32, decision_of(source).reason if decision_of(source) else Reason.FP32_INPUT
            )
        elif source_dtype in (torch.float16, torch.bfloat16) and keeps_island(node):
            decide_island(node, FP32)
            for user in outside_island(node):  # export routes later uses of x through x.float()
                user.replace_input_with(node, source)
                self.modified = True
        elif self.policy.precision_for(node) == Precision.LOW:
            self.retarget(node, self.low)
        else:
            self.decide_fp32(node, Reason.POLICY)

    def visit_other_cast(self, node: Node) -> None:
        if cast_dtype(node) is None:
            self.visit_compute(node)

    def retarget(self, node: Node, dtype: torch.dtype) -> None:
        set_cast_dtype(node, dtype)
        node.meta[INSERTED] = WHY_RETARGETED
        decide_island(node, dtype)
        self.modified = True

    def visit_creation(self, node: Node) -> None:
        precision = self.policy.precision_for(node)
        if precision in (Precision.FOLLOW, Precision.PROMOTE):
            if any(was_narrowed(arg) for arg in tensor_inputs(node)):  # *_like of a 16-bit value
                self.follow(node, promote=False)
            return
        reason = self.forced(node) or (Reason.POLICY if precision == Precision.FP32 else None)
        rounded = []
        for location, value in value_scalars(node):
            new_value = round_scalar_to_fp16(float(value), self.low)
            if new_value is None:
                reason = reason or Reason.SCALAR_OVERFLOW
            rounded.append((location, new_value if isinstance(value, float) else value))
        if reason is not None:
            # *_like and new_* ops follow their input's dtype, which may be fp16 by now
            if node.kwargs.get("dtype") != FP32:
                node.kwargs = {**node.kwargs, "dtype": FP32}
                self.modified = True
            self.decide_fp32(node, reason)
            return
        for location, value in rounded:
            set_argument(node, location, value)
        node.kwargs = {**node.kwargs, "dtype": self.low}
        node.meta["val"] = retype_val(node.meta["val"], self.low)
        decide(node, self.low, Reason.FITS)
        self.modified = True

    def visit_opaque(self, node: Node) -> None:
        """Run a region as exported, fed fp32: ``torch.autocast(enabled=False)`` regions
        the model wrote, and higher-order ops fx16 does not look inside (scan, ...)."""
        if any(was_narrowed(arg) for arg in tensor_inputs(node)):
            self.upcast_inputs(node)
            disabled_autocast = node.target is AUTOCAST
            decide(
                node,
                FP32,
                Reason.AUTOCAST_DISABLED if disabled_autocast else Reason.OPAQUE_SUBGRAPH,
            )

    def visit_autocast_region(self, node: Node) -> None:
        """``torch.autocast(enabled=True, dtype=d)``: the op enters autocast when it runs,
        so the region computes in d whatever it is fed. Feed it the 16-bit values as
        they are and recompute what it returns under the same autocast."""
        device, dtype, _, _, body, *operands = node.args
        if not any(was_narrowed(arg) for arg in operands if isinstance(arg, Node)):
            return
        submodule = getattr(self.graph_module, body.target)
        inputs = [node_val(arg) for arg in operands]
        fake_mode = next(val.fake_mode for val in inputs if hasattr(val, "fake_mode"))
        with torch.autocast(device_type=device, dtype=dtype):
            FakeTensorProp(submodule, fake_mode).propagate_dont_convert_inputs(*inputs)
        node.meta["val"] = tuple(node_val(out) for out in submodule.graph.output_node().args[0])
        decide(node, dtype, Reason.AUTOCAST_REGION)
        self.modified = True

    def visit_subgraphs(self, node: Node) -> None:
        """cond branches, set_grad_enabled bodies, while_loop and map bodies: cast
        inside them like anywhere else.

        Each body sees the operands in their current dtypes, except the values a
        while_loop carries from one iteration to the next: they enter and leave the
        body in their exported dtype, so the loop's state keeps its precision over
        every iteration, and ops inside read them through casts where they fit.
        Where cond's branches return different dtypes, both return fp32 for that output.
        """
        carried = carried_count(node)
        if carried:
            self.upcast_carried(node)
        body_nodes, operands = bodies_and_operands(node)
        submodules = [getattr(self.graph_module, body.target) for body in body_nodes]
        for submodule in submodules:
            placeholders = submodule.graph.find_nodes(op="placeholder")
            for index, (placeholder, operand) in enumerate(zip(placeholders, operands)):
                dtype = node_dtype(operand)
                placeholder.meta["val"] = retype_val(placeholder.meta["val"], dtype)
                if index < carried and dtype == FP32:
                    decide(placeholder, FP32, Reason.LOOP_CARRIED)
                elif decision_of(operand) is not None:
                    placeholder.meta[PRECISION] = decision_of(operand)
            observed = any(  # a run reached the body's ops (its placeholders share observations)
                CalibrationAnalysis.META_KEY in n.meta
                for n in submodule.graph.nodes
                if n.op == "call_function"
            )
            inner = _Run(submodule, self.policy, self.limit, calibrated=observed, root=self.root)
            inner.walk()
            if carried and submodule is submodules[-1]:  # the loop body returns the state
                inner.restore_output_dtypes({i: node_dtype(operands[i]) for i in range(carried)})
                submodule.recompile()
            self.modified |= inner.modified
        if node.target is WHILE_LOOP:
            decide(node, FP32, Reason.LOOP_CARRIED)
            return
        outputs = _unify_outputs(submodules)
        if node.target is MAP:  # each output stacks the body's results
            node.meta["val"] = type(node.meta["val"])(
                retype_val(val, node_dtype(out)) for val, out in zip(node.meta["val"], outputs)
            )
        else:
            node.meta["val"] = tuple(node_val(out) for out in outputs)
        narrowed = any(node_dtype(out) == self.low for out in outputs)
        decide(node, self.low if narrowed else FP32, Reason.FITS if narrowed else Reason.FP32_INPUT)

    def visit_shared_body(self, node: Node) -> None:
        """``invoke_subgraph``: a body that several call sites may share is cast once.

        At the first call site, each placeholder takes its operand's dtype, unless the
        value it holds at any call site must stay fp32 (a safety rule keeps an operand,
        or calibration saw the placeholder hold more than 16-bit's range over all the
        sites): then fp32, and a 16-bit operand is upcast. At every later site, each
        operand is cast to the dtype its placeholder took (calibration saw it fit)."""
        body_node, _, *operands = node.args
        body = getattr(self.graph_module, body_node.target)
        placeholders = body.graph.find_nodes(op="placeholder")
        if not any(decision_of(n) is not None for n in body.graph.nodes):
            sites = [
                site.args[2:]
                for site in node.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)
                if getattr(self.graph_module, site.args[0].target) is body
            ]
            for index, placeholder in enumerate(placeholders):
                operand = operands[index]
                if node_dtype(placeholder) not in FLOAT_DTYPES:
                    continue
                held = [site[index] for site in sites if isinstance(site[index], Node)]
                if any(self.forced(value) for value in held) or self.overflows(placeholder):
                    decide(placeholder, FP32, Reason.FP32_INPUT)
                    dtype = FP32
                else:
                    dtype = node_dtype(operand)
                    if decision_of(operand) is not None:
                        placeholder.meta[PRECISION] = decision_of(operand)
                placeholder.meta["val"] = retype_val(placeholder.meta["val"], dtype)
            observed = any(CalibrationAnalysis.META_KEY in n.meta for n in body.graph.nodes)
            inner = _Run(body, self.policy, self.limit, calibrated=observed, root=self.root)
            inner.walk()
            self.modified |= inner.modified
        aligned = [self.aligned(arg, node_dtype(p)) for arg, p in zip(operands, placeholders)]
        if any(new is not old for new, old in zip(aligned, operands)):
            node.args = (*node.args[:2], *aligned)
            self.modified = True
        outputs = body.graph.output_node().args[0]
        node.meta["val"] = tuple(node_val(out) for out in outputs)
        narrowed = any(node_dtype(out) == self.low for out in outputs)
        decide(node, self.low if narrowed else FP32, Reason.FITS if narrowed else Reason.FP32_INPUT)

    def aligned(self, value, dtype: torch.dtype | None):
        """``value`` in ``dtype``, through a cast when it differs (a float operand)."""
        current = node_dtype(value)
        if current not in FLOAT_DTYPES or dtype not in FLOAT_DTYPES or current == dtype:
            return value
        if dtype == FP32:
            return self.widened(value) if was_narrowed(value) else value
        return self.casts.cast(value, dtype, WHY_NARROW)

    def upcast_carried(self, node: Node) -> None:
        """A while_loop's carried operands that fx16 narrowed go back to fp32."""
        condition, body, carried, additional = node.args
        widened = tuple(self.widened(arg) if isinstance(arg, Node) else arg for arg in carried)
        if any(new is not old for new, old in zip(widened, carried)):
            node.args = (condition, body, widened, additional)

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
            node.meta[PRECISION] = decision_of(written)

    # ---- ordinary ops --------------------------------------------------------------

    def visit_compute(self, node: Node) -> None:
        float_inputs = [arg for arg in tensor_inputs(node) if node_dtype(arg) in FLOAT_DTYPES]
        produces_fp32 = has_fp32_part(node_val(node))
        if not any(was_narrowed(arg) or node_dtype(arg) == FP32 for arg in float_inputs):
            if produces_fp32 and not float_inputs:
                decide(node, FP32, Reason.NO_FLOAT_INPUT)
            return

        precision = self.policy.precision_for(node)
        scalars = value_scalars(node)
        dtype_args = dtype_arguments(node)
        explicit_fp32 = FP32 in requested_dtypes(node)
        fp32_inputs = [arg for arg in float_inputs if node_dtype(arg) == FP32]
        kept_fp32 = [arg for arg in fp32_inputs if not self.downcastable(arg)]
        other_float = any(node_dtype(arg) not in (self.low, FP32) for arg in float_inputs)

        if explicit_fp32 and keeps_island(node):
            decide_island(node, FP32)
        elif fp32_inputs and all(is_island(arg) for arg in float_inputs):
            decide(node, FP32, Reason.EXPLICIT_FP32, detail=decision_of(fp32_inputs[0]).detail)
        elif self.forced(node):
            self.run_in_fp32(node, self.forced(node), produces_fp32)
        elif precision == Precision.FP32:
            self.run_in_fp32(node, Reason.POLICY, produces_fp32, self.policy.cast_back)
        elif precision in (Precision.FOLLOW, Precision.PROMOTE):
            self.follow(node, promote=precision == Precision.PROMOTE)
        elif kept_fp32:
            self.run_in_fp32(node, Reason.FP32_INPUT, produces_fp32)
        elif any(round_scalar_to_fp16(float(v), self.low) is None for _, v in scalars):
            self.run_in_fp32(node, Reason.SCALAR_OVERFLOW, produces_fp32)
        elif other_float and produces_fp32:
            self.run_in_fp32(node, Reason.MIXED_FLOAT_DTYPES, produces_fp32)
        else:
            self.run_in_low(node, scalars, dtype_args, produces_fp32)

    def downcastable(self, value: Node) -> bool:
        """An fp32 value kept wide for precision (by the policy, the accuracy budget for
        some of its uses, or a loop carrying it), not by a safety rule, and that fits
        16-bit: a 16-bit op reading it may cast it down, as eager autocast does with
        weights."""
        decision = decision_of(value)
        return (
            decision is not None and decision.reason in _DOWNCASTABLE and not self.overflows(value)
        )

    def follow(self, node: Node, promote: bool) -> None:
        """Run ``node`` in the dtype its inputs give it (``promote``: their widest first)."""
        if promote:
            inputs = [arg for arg in tensor_inputs(node) if node_dtype(arg) in FLOAT_DTYPES]
            widest = max((node_dtype(arg) for arg in inputs), key=float_rank, default=None)

            def widen(arg: Node) -> Node:
                if node_dtype(arg) in FLOAT_DTYPES and node_dtype(arg) != widest:
                    return self.casts.cast(arg, widest, WHY_UPCAST)
                return arg

            substitute_inputs(node, widen)
        input_dtypes = {node_dtype(a) for a in tensor_inputs(node) if node_dtype(a) in FLOAT_DTYPES}
        try:
            result = propagate_fake(node)
            if len(input_dtypes) > 1:  # mixed float inputs: trust a real kernel, not the meta one
                result = output_dtypes_by_running(node, result)
        except RuntimeError:
            if promote or len(input_dtypes) < 2:
                raise
            # the op cannot mix float dtypes (a convolution with bf16 input, fp32 weight):
            # it runs in the widest of them
            self.follow(node, promote=True)
            return
        dtypes = {leaf.dtype for leaf in tensor_leaves(result) if leaf.is_floating_point()}
        scalar_overflow = any(
            round_scalar_to_fp16(float(v), self.low) is None for _, v in value_scalars(node)
        )
        if self.low in dtypes and scalar_overflow:  # safety first: the scalar needs fp32
            self.run_in_fp32(node, Reason.SCALAR_OVERFLOW, True, self.policy.cast_back)
            return
        node.meta["val"] = result
        dtype = self.low if self.low in dtypes else FP32
        decide(node, dtype, Reason.POLICY_FOLLOW, detail=self.policy.matching_entry(node)[1])
        self.modified = True

    def run_in_low(self, node: Node, scalars, dtype_args, produces_fp32: bool) -> None:
        self.downcast_inputs(node)
        clamped = []
        for location, value in scalars:
            rounded = round_scalar_to_fp16(value, self.low) if isinstance(value, float) else value
            if rounded != value:
                set_argument(node, location, rounded)
                self.modified = True
                if value and abs(value) < smallest_subnormal(self.low):
                    clamped.append((value, rounded))
        for location, dtype in dtype_args:
            if dtype == FP32:
                set_argument(node, location, self.low)
                self.modified = True
        result = narrowed_result(node, self.low, produces_fp32)
        if result is not node_val(node):
            node.meta["val"] = result
            self.modified = True
        if is_custom_op(node.target) and has_fp32_part(result):
            decide(node, FP32, Reason.FIXED_OUTPUT_DTYPE)
        else:
            decide_island(node, self.low)
            refuted = node.meta.get(VerdictCheckAnalysis.META_KEY)
            if refuted and decision_of(node).reason == Reason.FITS:
                decide(node, self.low, Reason.NOT_WORTH_FP32, detail=refuted)
            elif clamped and decision_of(node).reason == Reason.FITS:
                scalars = ", ".join(f"{value:g} -> {new:.3g}" for value, new in clamped)
                decide(node, self.low, Reason.SCALAR_CLAMPED, detail=scalars)

    def downcast_inputs(self, node: Node) -> None:
        def downcast(arg: Node) -> Node:
            if node_dtype(arg) != FP32 or not self.downcastable(arg):
                return arg
            self.modified = True
            return self.casts.cast(arg, self.low, WHY_NARROW)

        substitute_inputs(node, downcast)

    def run_in_fp32(
        self, node: Node, reason: Reason, produces_fp32: bool, cast_back: bool = True
    ) -> None:
        self.upcast_inputs(node)
        self.decide_fp32(node, reason)
        if isinstance(node_val(node), torch.Tensor) and produces_fp32 and cast_back:
            self.cast_back(node, reason)

    def decide_fp32(self, node: Node, reason: Reason) -> None:
        """fp32 for ``reason``, with the rule's detail when a rule gave that reason."""
        rule = fp32_rule(node)
        if rule and rule.reason == reason:
            detail = rule.detail
        else:
            detail = self.policy.matching_entry(node)[1] if reason == Reason.POLICY else ""
        decide(node, FP32, reason, detail=detail)

    def upcast_inputs(self, node: Node) -> None:
        substitute_inputs(node, self.widened)

    def widened(self, arg: Node) -> Node:
        """``arg`` in fp32 if fx16 narrowed it (through a cast), else ``arg`` itself."""
        if not was_narrowed(arg) or node_dtype(arg) != self.low:
            return arg
        self.modified = True
        # Reading a value we cast back from fp32 a moment ago: use the fp32 original.
        return cast_back_source(arg, FP32) or self.casts.cast(arg, FP32, WHY_UPCAST)

    def cast_back(self, node: Node, reason: Reason) -> None:
        """Give the consumers of an fp32 result an fp16 value, unless it does not fit.

        Casts among the consumers convert anyway, so a node used only by casts gets none.
        """
        if not self.calibrated or self.overflows(node) or all(is_cast(u) for u in node.users):
            return
        back = self.casts.cast_after(node, self.low, WHY_CAST_BACK)
        decide(back, self.low, reason)
        self.modified = True

    def return_fp32_outputs(self) -> None:
        """Outputs computed in fp32 are returned as fp32 (their cast-backs skipped)."""
        output = self.casts.graph.output_node()
        returned = [
            cast_back_source(value, FP32) or value if isinstance(value, Node) else value
            for value in output.args[0]
        ]
        output.args = (type(output.args[0])(returned), *output.args[1:])

    def restore_output_dtypes(self, required: dict[int, torch.dtype]) -> None:
        """Outputs that keep a dtype get it back, through a cast that feeds only them:
        mutated buffers and inputs (written back in their own dtype), and outputs kept
        by ``keep_io_types``."""
        output = self.casts.graph.output_node()
        returned = list(output.args[0])
        for index, dtype in required.items():
            value = returned[index]
            if not isinstance(value, Node) or node_dtype(value) in (None, dtype):
                continue
            if is_inserted(value) and node_dtype(value.args[0]) == dtype:
                returned[index] = value.args[0]
            else:
                returned[index] = self.casts.cast(value, dtype, WHY_OUTPUT_DTYPE)
        if returned != list(output.args[0]):
            output.args = (type(output.args[0])(returned), *output.args[1:])
            self.modified = True
