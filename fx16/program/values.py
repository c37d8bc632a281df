"""Every value of a program as it runs, with its stable id: a generator interpreter,
so that two programs can run in lockstep, one node at a time (``fx16.diagnose``).

The bodies of ``cond`` (the branch taken), ``while_loop`` (every iteration), ``map``
(every slice) and ``invoke_subgraph`` run node by node; autocast and
``set_grad_enabled`` regions run whole. Each value is dropped after its last use.
"""

from collections.abc import Iterator
from typing import Any

import torch.utils._pytree as pytree
from torch.fx import Node

from fx16.program import Program
from fx16.program.interpreter import body_runs
from fx16.program.node_ids import has_ids, node_id
from fx16.program.subgraphs import attribute, bodies_and_operands


def program_values(program: Program, inputs: list) -> Iterator[tuple[tuple[str, int], Node, Any]]:
    """Run ``program``'s graph on its flat graph inputs, yielding ``((id, occurrence),
    node, value)`` for every value with an id, in execution order. The state (weights,
    buffers) is not yielded: its rounding is the cast's to report, and comparing a
    vocabulary's embedding in fp64 would take more memory than all the activations."""
    root = program.graph_module
    state = {slot.placeholder for slot in program.state_slots()}
    counts: dict[str, int] = {}
    yield from _run_graph(root, "", has_ids(root), inputs, counts, state)


def _run_graph(module, prefix, assigned, inputs, counts, state):
    """A generator interpreter: runs ``module``'s graph, yields its values (and those of
    the bodies it runs; not the ``state`` placeholders'), returns its outputs. Each value
    is dropped after its last use."""
    nodes = list(module.graph.nodes)
    last_use: dict[Node, Node] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            last_use[arg] = node
    env: dict[Node, Any] = {}
    feed = iter(inputs)
    for node in nodes:
        if node.op == "placeholder":
            value = next(feed)
        elif node.op == "get_attr":
            value = attribute(module, node.target)
        elif node.op == "output":
            return pytree.tree_map(
                lambda arg: env[arg] if isinstance(arg, Node) else arg, node.args[0]
            )
        else:
            args, kwargs = pytree.tree_map(
                lambda arg: env[arg] if isinstance(arg, Node) else arg, (node.args, node.kwargs)
            )
            value = yield from _call(node, prefix, assigned, args, kwargs, counts, state, module)
        env[node] = value
        identity = node_id(node, prefix, assigned)
        if identity is not None and node not in state:
            counts[identity] = counts.get(identity, 0) + 1
            yield (identity, counts[identity]), node, value
        for arg in node.all_input_nodes:
            if last_use.get(arg) is node:
                env.pop(arg, None)
    return None


def _call(node, prefix, assigned, args, kwargs, counts, state, module):
    """Run one op; the bodies of the higher-order ops fx16 looks into, node by node
    (``body_runs``; autocast and set_grad regions run whole: their mode would be set
    while the other program of a lockstep run computes)."""
    runs = body_runs(node.target, args, regions=False)
    if runs is None:
        return node.target(*args, **kwargs)
    bodies = bodies_and_operands(node)[0]
    names = {id(attribute(module, body.target)): body.target for body in bodies}
    try:
        body, operands = next(runs)
        while True:
            name = names[id(body)]
            outputs = yield from _run_graph(
                body, f"{prefix}{name}.", assigned, list(operands), counts, state
            )
            body, operands = runs.send(outputs)
    except StopIteration as done:
        return done.value
