"""Higher-order ops for the fp16 cast inserter: applying their steps.

``fx16.plan.bodies`` plans each body of ``cond``, ``while_loop``, ``map``,
``set_grad_enabled`` and ``invoke_subgraph`` with the operands' dtypes and decisions
on its placeholders; these functions carry the plans out. An enabled autocast region
is recomputed under its own dtype; a disabled one, and a higher-order op fx16 does not
look inside, runs as exported, fed fp32.

Each function takes the walk of the enclosing graph (``run``: a
``fx16.passes.insert_fp16_casts`` walk), the higher-order op's node and its step.
Writes: the bodies' placeholders' dtypes and decisions, the bodies' casts, the op's
operands, ``meta["val"]`` and decision.
"""

import torch
from torch.fx import Node
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fx16.decisions import PRECISION
from fx16.plan.steps import Step
from fx16.program.casts import WHY_UPCAST, CastInserter, substitute_inputs
from fx16.program.nodes import node_val
from fx16.program.subgraphs import bodies_and_operands, with_operands

FP32 = torch.float32


def apply_opaque(run, node: Node, step: Step) -> None:
    """A region run as exported (``torch.autocast(enabled=False)``, a higher-order op
    fx16 does not look inside): fed fp32."""
    substitute_inputs(node, run.widened)
    run.record(node, step)


def apply_autocast(run, node: Node, step: Step) -> None:
    """``torch.autocast(enabled=True, dtype=d)`` fed the 16-bit values as they are: the
    body's recorded values are recomputed under the same autocast."""
    device, dtype, _, _, body, *operands = node.args
    submodule = getattr(run.graph_module, body.target)
    inputs = [node_val(arg) for arg in operands]
    fake_mode = next(val.fake_mode for val in inputs if hasattr(val, "fake_mode"))
    with torch.autocast(device_type=device, dtype=dtype):
        FakeTensorProp(submodule, fake_mode).propagate_dont_convert_inputs(*inputs)
    run.record(node, step)
    run.modified = True


def apply_subgraphs(run, node: Node, step: Step) -> None:
    """cond branches, set_grad_enabled bodies, while_loop and map bodies: the operands
    the plan feeds fp32 widened (a loop's carried state, a value a body keeps fp32),
    each body's placeholders fed and its plan applied (a loop body returning the state
    in the dtypes it came in), the outputs the plan widens for cond's branches to agree."""
    _widen_operands(run, node, step.wide_operands)
    submodules = [getattr(run.graph_module, body.target) for body in bodies_and_operands(node)[0]]
    for number, (submodule, plan, fed) in enumerate(zip(submodules, step.bodies, step.entries)):
        _feed(fed)
        inner = run.apply_body(submodule, plan)
        if step.carried and number == len(submodules) - 1:
            inner.restore_output_dtypes(step.carried)
            submodule.recompile()
        run.modified |= inner.modified
    widened = {number for number, _ in step.outputs}
    for number in widened:
        submodule = submodules[number]
        output = submodule.graph.output_node()
        values = list(output.args[0])
        for body, index in step.outputs:
            if body == number:
                values[index] = CastInserter(submodule.graph).cast(values[index], FP32, WHY_UPCAST)
        output.args = (type(output.args[0])(values), *output.args[1:])
        submodule.recompile()
    run.record(node, step)


def apply_shared(run, node: Node, step: Step) -> None:
    """``invoke_subgraph``: the shared body's plan applied at its first call site; at
    every site, each operand cast to the dtype its placeholder took."""
    body_node, _, *operands = node.args
    if step.bodies:
        _feed(step.entries[0])
        body = getattr(run.graph_module, body_node.target)
        run.modified |= run.apply_body(body, step.bodies[0]).modified
    aligned = [run.aligned(arg, dtype) for arg, dtype in zip(operands, step.operand_dtypes)]
    if any(new is not old for new, old in zip(aligned, operands)):
        node.args = (*node.args[:2], *aligned)
        run.modified = True
    run.record(node, step)


def _feed(fed: dict) -> None:
    """Give a body's placeholders the values and decisions their operands feed them."""
    for placeholder, read in fed.items():
        placeholder.meta["val"] = read.val
        if read.decision is not None:
            placeholder.meta[PRECISION] = read.decision


def _widen_operands(run, node: Node, wide: tuple) -> None:
    """The operands the plan feeds fp32 (a while_loop's carried state, a value a body's
    safety rule keeps fp32) widened where fx16 narrowed them."""
    operands = bodies_and_operands(node)[1]
    widened = [
        run.widened(arg) if index in wide and isinstance(arg, Node) else arg
        for index, arg in enumerate(operands)
    ]
    if any(new is not old for new, old in zip(widened, operands)):
        node.args = with_operands(node, widened)
