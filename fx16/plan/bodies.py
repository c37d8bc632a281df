"""Planning higher-order ops: the bodies fx16 casts inside, and those it does not.

``cond``, ``while_loop``, ``map``, ``set_grad_enabled`` and ``invoke_subgraph``
bodies get plans of their own, each with its placeholders read as the operands feed
them (their dtypes and decisions), so a fact about a value holds inside the body too.
An enabled autocast region is recomputed under its own dtype; a disabled one, and a
higher-order op fx16 does not look inside, runs as exported, fed fp32.

Each function takes the planner of the enclosing graph (``fx16.plan.planner.Planner``)
and the higher-order op's node, and returns its ``Step`` (None: nothing to change).
Reads and writes as the planner does: nothing on the graph or its bodies.
"""

import torch
from torch.fx import Interpreter, Node

from fx16 import meta
from fx16.decisions import Reason, decision, decision_of
from fx16.plan.steps import Read, Step, graph_read
from fx16.program.casts import retype_val
from fx16.program.nodes import FLOAT_DTYPES, node_dtype, node_val, tensor_inputs
from fx16.program.subgraphs import AUTOCAST, MAP, WHILE_LOOP, bodies_and_operands, carried_count

FP32 = torch.float32


def plan_opaque(planner, node: Node) -> Step | None:
    """A region run as exported, fed fp32: ``torch.autocast(enabled=False)`` regions the
    model wrote, and higher-order ops fx16 does not look inside (scan, ...)."""
    if not any(planner.plan.read(arg, node).narrowed for arg in tensor_inputs(node)):
        return None
    reason = Reason.AUTOCAST_DISABLED if node.target is AUTOCAST else Reason.OPAQUE_SUBGRAPH
    return Step(None, decision(FP32, reason), node_val(node))


def plan_autocast(planner, node: Node) -> Step | None:
    """``torch.autocast(enabled=True, dtype=d)``: the op enters autocast when it runs,
    so the region computes in d whatever it is fed. It is fed the 16-bit values as they
    are, and returns what its body computes from them under the same autocast."""
    device, dtype, enabled, _, body, *operands = node.args
    if not enabled:  # a disabled region runs as it is
        return plan_opaque(planner, node)
    reads = [planner.plan.read(arg, node) if isinstance(arg, Node) else None for arg in operands]
    if not any(read is not None and read.narrowed for read in reads):
        return None
    submodule = getattr(planner.graph_module, body.target)
    inputs = [read.val if read is not None else None for read in reads]
    fake_mode = next(val.fake_mode for val in inputs if hasattr(val, "fake_mode"))
    with fake_mode, torch.autocast(device_type=device, dtype=dtype):
        outputs = Interpreter(submodule).run(*inputs)
    return Step(None, decision(dtype, Reason.AUTOCAST_REGION), tuple(outputs))


def plan_subgraphs(planner, node: Node) -> Step:
    """cond branches, set_grad_enabled bodies, while_loop and map bodies: planned like
    anywhere else.

    Each body reads the operands as the plan leaves them, except the values a
    while_loop carries from one iteration to the next: they enter and leave the body
    in their exported dtype (widened where fx16 narrowed them), so the loop's state
    keeps its precision over every iteration, and ops inside read them through casts
    where they fit; so do the operands whose placeholder a safety rule keeps fp32 in
    any body (a rotary angle a branch's cos reads: narrowed at the boundary, it would
    reach the cos rounded however its chain was kept). Where cond's branches return
    different dtypes, both return fp32 for that output.
    """
    plan, carried = planner.plan, carried_count(node)
    body_nodes, operands = bodies_and_operands(node)
    submodules = [getattr(planner.graph_module, body.target) for body in body_nodes]
    wide = set(range(carried))
    for submodule in submodules:  # a body's placeholder a rule keeps fp32: fed fp32
        placeholders = submodule.graph.find_nodes(op="placeholder")
        wide = wide | {i for i, p in enumerate(placeholders) if meta.fp32_rule(p) is not None}
    reads = [
        (plan.widened(arg, node) if index in wide else plan.read(arg, node))
        if isinstance(arg, Node)
        else None
        for index, arg in enumerate(operands)
    ]
    bodies, entries = [], []
    for submodule in submodules:
        placeholders = submodule.graph.find_nodes(op="placeholder")
        fed = {}
        for index, (placeholder, read) in enumerate(zip(placeholders, reads)):
            dtype = read.dtype if read is not None else None
            val = retype_val(placeholder.meta["val"], dtype)
            if index < carried and dtype == FP32:
                made = decision(FP32, Reason.LOOP_CARRIED)
            else:
                made = _inherited(read, placeholder)
            fed[placeholder] = Read(val, made, placeholder.name)
        # a run reached the body's ops (its placeholders share the operands' observations)
        observed = any(
            meta.was_observed(n) for n in submodule.graph.nodes if n.op == "call_function"
        )
        bodies.append(_plan_body(planner, submodule, observed, fed))
        entries.append(fed)
    step = Step(None, None, node_val(node), bodies=tuple(bodies), entries=tuple(entries))
    step.wide_operands = tuple(sorted(wide))
    if node.target is WHILE_LOOP:  # the body returns the state in the dtypes it came in
        step.carried = {index: reads[index].dtype for index in range(carried)}
        step.decision = decision(FP32, Reason.LOOP_CARRIED)
        return step
    outputs, step.outputs = _unified_outputs(bodies)
    if node.target is MAP:  # each output stacks the body's results
        step.val = type(step.val)(retype_val(val, out.dtype) for val, out in zip(step.val, outputs))
    else:
        step.val = tuple(out.val if out is not None else None for out in outputs)
    step.decision = _by_outputs(planner, outputs)
    return step


def plan_shared(planner, node: Node) -> Step:
    """``invoke_subgraph``: a body that several call sites may share is planned once.

    At the first call site, each placeholder takes its operand's dtype, unless the
    value it holds at any call site must stay fp32 (a safety rule keeps an operand, or
    calibration saw the placeholder hold more than 16-bit's range over all the sites):
    then fp32, and a 16-bit operand is upcast. At every later site, each operand is
    cast to the dtype its placeholder took (calibration saw it fit)."""
    body_node, _, *operands = node.args
    body = getattr(planner.graph_module, body_node.target)
    placeholders = body.graph.find_nodes(op="placeholder")
    step = Step(None, None, None)
    plan = planner.shared.get(id(body))
    if plan is None and not any(decision_of(n) is not None for n in body.graph.nodes):
        sites = [
            site.args[2:]
            for site in node.graph.find_nodes(op="call_function", target=node.target)
            if getattr(planner.graph_module, site.args[0].target) is body
        ]
        fed = {}
        for index, placeholder in enumerate(placeholders):
            if node_dtype(placeholder) not in FLOAT_DTYPES:
                continue
            held = [site[index] for site in sites if isinstance(site[index], Node)]
            why = _why_fp32_operand(planner, placeholder, held)
            operand = operands[index]
            read = planner.plan.read(operand, node) if isinstance(operand, Node) else None
            if why:
                dtype, made = FP32, decision(FP32, Reason.FP32_INPUT, why)
            else:
                dtype, made = (
                    read.dtype if read is not None else None,
                    _inherited(read, placeholder),
                )
            fed[placeholder] = Read(
                retype_val(placeholder.meta["val"], dtype), made, placeholder.name
            )
        observed = any(meta.was_observed(n) for n in body.graph.nodes)
        plan = planner.shared[id(body)] = _plan_body(planner, body, observed, fed)
        step.bodies, step.entries = (plan,), (fed,)
    read = plan.read if plan is not None else lambda arg, consumer=None: graph_read(arg)
    step.operand_dtypes = tuple(read(placeholder).dtype for placeholder in placeholders)
    output = body.graph.output_node()
    outputs = [read(out, output) if isinstance(out, Node) else None for out in output.args[0]]
    step.val = tuple(out.val if out is not None else None for out in outputs)
    step.decision = _by_outputs(planner, outputs)
    return step


def _plan_body(planner, body, observed: bool, fed: dict):
    """The plan of a body, by a planner like ``planner`` (bodies share ``shared``)."""
    return type(planner)(body, planner.policy, planner.limit, observed, fed, planner.shared).run()


def _inherited(read: Read | None, placeholder: Node):
    """A body placeholder carries its operand's decision (if it has one)."""
    if read is not None and read.decision is not None:
        return read.decision
    return decision_of(placeholder)


def _why_fp32_operand(planner, placeholder: Node, held: list[Node]) -> str:
    """Why a shared body's placeholder stays fp32 ("" when it need not)."""
    kept = [value for value in held if meta.fp32_rule(value)]
    if kept:
        return f"from {kept[0].name}: {meta.fp32_rule(kept[0]).reason.name.lower()}"
    if meta.overflows(placeholder, planner.limit):
        return f"observed {meta.observed_max_abs(placeholder):.4g} over its call sites"
    return ""


def _by_outputs(planner, outputs: list) -> object:
    if any(out is not None and out.dtype == planner.low for out in outputs):
        return decision(planner.low, Reason.FITS)
    return decision(FP32, Reason.FP32_INPUT, "no output of its bodies is 16-bit")


def _unified_outputs(bodies) -> tuple[list, tuple]:
    """Every body returns the same dtype per output (fp32 where they disagree).

    Returns the first body's outputs as its consumers read them, and the
    ``(body index, output index)`` pairs whose output is widened to fp32."""
    outputs = []
    for plan in bodies:
        output = plan.graph_module.graph.output_node()
        outputs.append(
            [plan.read(out, output) if isinstance(out, Node) else None for out in output.args[0]]
        )
    widened = []
    for index, candidates in enumerate(zip(*outputs)):
        if len({read.dtype if read is not None else None for read in candidates}) < 2:
            continue
        for number, values in enumerate(outputs):
            value = values[index]
            if value is None or value.dtype != FP32:
                values[index] = Read(retype_val(value.val, FP32), None, "")
                widened.append((number, index))
    return outputs[0], tuple(widened)
