"""Every value of a program as it runs, with its stable id: a generator interpreter,
so that two programs can run in lockstep, one node at a time (``fx16.diagnose``).

The bodies of ``cond`` (the branch taken), ``while_loop`` (every iteration), ``map``
(every slice) and ``invoke_subgraph`` run node by node; autocast and
``set_grad_enabled`` regions run whole. Each value is dropped after its last use.
"""

from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx import Node

from fx16.node_ids import has_ids, node_id
from fx16.program import Program
from fx16.subgraphs import COND, INVOKE_SUBGRAPH, MAP, WHILE_LOOP, attribute


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
    """Run one op; the bodies of the higher-order ops fx16 looks into, node by node."""
    target = node.target

    def body_prefix(body_node: Node) -> str:
        return f"{prefix}{body_node.target}."

    def run(body_node, operands):
        body = attribute(module, body_node.target)
        return (
            yield from _run_graph(
                body, body_prefix(body_node), assigned, list(operands), counts, state
            )
        )

    if target is COND:
        predicate, _, _, operands = args
        chosen = node.args[1] if bool(predicate) else node.args[2]
        return tuple((yield from run(chosen, operands)))
    if target is WHILE_LOOP:
        _, _, carried, additional = args
        carried = tuple(carried)
        while True:
            go = yield from run(node.args[0], (*carried, *additional))
            if not bool(pytree.tree_leaves(go)[0]):
                return carried
            carried = tuple((yield from run(node.args[1], (*carried, *additional))))
    if target is MAP and args[1][0].shape[0] > 0:
        _, mapped, others = args
        slices = []
        for index in range(mapped[0].shape[0]):
            operands = (*(tensor[index] for tensor in mapped), *others)
            slices.append((yield from run(node.args[0], operands)))
        return [torch.stack(parts) for parts in zip(*slices)]
    if target is INVOKE_SUBGRAPH:
        return tuple((yield from run(node.args[0], args[2:])))
    return target(*args, **kwargs)  # an autocast or set_grad region runs whole
