"""Higher-order ops for the fp16 cast inserter: the bodies it casts inside, and those it does not.

``cond``, ``while_loop``, ``map``, ``set_grad_enabled`` and ``invoke_subgraph``
bodies are walked like the program's graph, each with the operands' dtypes and
decisions on its placeholders, so a fact about a value holds inside the body too.
An enabled autocast region is recomputed under its own dtype; a disabled one, and a
higher-order op fx16 does not look inside, runs as exported, fed fp32.

Each function takes the walk of the enclosing graph (``run``: a
``fx16.passes.insert_fp16_casts`` walk) and the higher-order op's node. Writes: the
bodies' placeholders' dtypes and decisions, the bodies' casts, the op's operands,
``meta["val"]`` and decision.
"""

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fx16 import meta
from fx16.casts import WHY_UPCAST, CastInserter, retype_val, substitute_inputs
from fx16.decisions import Reason, decide, decision_of, was_narrowed
from fx16.nodes import FLOAT_DTYPES, node_dtype, node_val, tensor_inputs
from fx16.subgraphs import AUTOCAST, MAP, WHILE_LOOP, bodies_and_operands, carried_count

FP32 = torch.float32


def visit_opaque(run, node: Node) -> None:
    """Run a region as exported, fed fp32: ``torch.autocast(enabled=False)`` regions
    the model wrote, and higher-order ops fx16 does not look inside (scan, ...)."""
    if any(was_narrowed(arg) for arg in tensor_inputs(node)):
        substitute_inputs(node, run.widened)
        disabled = node.target is AUTOCAST
        decide(node, FP32, Reason.AUTOCAST_DISABLED if disabled else Reason.OPAQUE_SUBGRAPH)


def visit_autocast_region(run, node: Node) -> None:
    """``torch.autocast(enabled=True, dtype=d)``: the op enters autocast when it runs,
    so the region computes in d whatever it is fed. Feed it the 16-bit values as they
    are and recompute what it returns under the same autocast."""
    device, dtype, _, _, body, *operands = node.args
    if not any(was_narrowed(arg) for arg in operands if isinstance(arg, Node)):
        return
    submodule = getattr(run.graph_module, body.target)
    inputs = [node_val(arg) for arg in operands]
    fake_mode = next(val.fake_mode for val in inputs if hasattr(val, "fake_mode"))
    with torch.autocast(device_type=device, dtype=dtype):
        FakeTensorProp(submodule, fake_mode).propagate_dont_convert_inputs(*inputs)
    node.meta["val"] = tuple(node_val(out) for out in submodule.graph.output_node().args[0])
    decide(node, dtype, Reason.AUTOCAST_REGION)
    run.modified = True


def visit_subgraphs(run, node: Node) -> None:
    """cond branches, set_grad_enabled bodies, while_loop and map bodies: cast inside
    them like anywhere else.

    Each body sees the operands in their current dtypes, except the values a
    while_loop carries from one iteration to the next: they enter and leave the body
    in their exported dtype, so the loop's state keeps its precision over every
    iteration, and ops inside read them through casts where they fit. Where cond's
    branches return different dtypes, both return fp32 for that output.
    """
    carried = carried_count(node)
    if carried:
        _upcast_carried(run, node)
    body_nodes, operands = bodies_and_operands(node)
    submodules = [getattr(run.graph_module, body.target) for body in body_nodes]
    for submodule in submodules:
        placeholders = submodule.graph.find_nodes(op="placeholder")
        for index, (placeholder, operand) in enumerate(zip(placeholders, operands)):
            dtype = node_dtype(operand)
            placeholder.meta["val"] = retype_val(placeholder.meta["val"], dtype)
            if index < carried and dtype == FP32:
                decide(placeholder, FP32, Reason.LOOP_CARRIED)
            else:
                run.inherit(placeholder, operand)
        # a run reached the body's ops (its placeholders share the operands' observations)
        observed = any(
            meta.was_observed(n) for n in submodule.graph.nodes if n.op == "call_function"
        )
        inner = run.walk_body(submodule, observed)
        if carried and submodule is submodules[-1]:  # the loop body returns the state
            inner.restore_output_dtypes({i: node_dtype(operands[i]) for i in range(carried)})
            submodule.recompile()
        run.modified |= inner.modified
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
    _decide_by_outputs(run, node, outputs)


def visit_shared_body(run, node: Node) -> None:
    """``invoke_subgraph``: a body that several call sites may share is cast once.

    At the first call site, each placeholder takes its operand's dtype, unless the
    value it holds at any call site must stay fp32 (a safety rule keeps an operand, or
    calibration saw the placeholder hold more than 16-bit's range over all the sites):
    then fp32, and a 16-bit operand is upcast. At every later site, each operand is
    cast to the dtype its placeholder took (calibration saw it fit)."""
    body_node, _, *operands = node.args
    body = getattr(run.graph_module, body_node.target)
    placeholders = body.graph.find_nodes(op="placeholder")
    if not any(decision_of(n) is not None for n in body.graph.nodes):
        sites = [
            site.args[2:]
            for site in node.graph.find_nodes(op="call_function", target=node.target)
            if getattr(run.graph_module, site.args[0].target) is body
        ]
        for index, placeholder in enumerate(placeholders):
            operand = operands[index]
            if node_dtype(placeholder) not in FLOAT_DTYPES:
                continue
            held = [site[index] for site in sites if isinstance(site[index], Node)]
            why = _why_fp32_operand(run, placeholder, held)
            if why:
                decide(placeholder, FP32, Reason.FP32_INPUT, detail=why)
                dtype = FP32
            else:
                dtype = node_dtype(operand)
                run.inherit(placeholder, operand)
            placeholder.meta["val"] = retype_val(placeholder.meta["val"], dtype)
        observed = any(meta.was_observed(n) for n in body.graph.nodes)
        run.modified |= run.walk_body(body, observed).modified
    aligned = [run.aligned(arg, node_dtype(p)) for arg, p in zip(operands, placeholders)]
    if any(new is not old for new, old in zip(aligned, operands)):
        node.args = (*node.args[:2], *aligned)
        run.modified = True
    outputs = body.graph.output_node().args[0]
    node.meta["val"] = tuple(node_val(out) for out in outputs)
    _decide_by_outputs(run, node, outputs)


def _why_fp32_operand(run, placeholder: Node, held: list[Node]) -> str:
    """Why a shared body's placeholder stays fp32 ("" when it need not)."""
    kept = [value for value in held if meta.fp32_rule(value)]
    if kept:
        return f"from {kept[0].name}: {meta.fp32_rule(kept[0]).reason.name.lower()}"
    if meta.overflows(placeholder, run.limit):
        return f"observed {meta.observed_max_abs(placeholder):.4g} over its call sites"
    return ""


def _decide_by_outputs(run, node: Node, outputs) -> None:
    if any(node_dtype(out) == run.low for out in outputs):
        decide(node, run.low, Reason.FITS)
    else:
        decide(node, FP32, Reason.FP32_INPUT, detail="no output of its bodies is 16-bit")


def _upcast_carried(run, node: Node) -> None:
    """A while_loop's carried operands that fx16 narrowed go back to fp32."""
    condition, body, carried, additional = node.args
    widened = tuple(run.widened(arg) if isinstance(arg, Node) else arg for arg in carried)
    if any(new is not old for new, old in zip(widened, carried)):
        node.args = (condition, body, widened, additional)


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
