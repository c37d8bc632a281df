"""Where the higher-order ops of an exported program keep their bodies, and what feeds them.

torch.export represents control flow and regions as ops that take GraphModules
(``get_attr`` nodes) plus operands; each op lays its arguments out differently.
"""

import torch
from torch.fx import Node

hop = torch.ops.higher_order
COND = hop.cond
WHILE_LOOP = hop.while_loop
MAP = hop.map_impl
AUTOCAST = hop.wrap_with_autocast
SET_GRAD = hop.wrap_with_set_grad_enabled
INVOKE_SUBGRAPH = hop.invoke_subgraph


def bodies_and_operands(node: Node) -> tuple[list[Node], list]:
    """The ``get_attr`` nodes of ``node``'s bodies, and the values fed to each body's
    placeholders in order (every body of one op takes the same operands: cond's
    branches, while_loop's condition and body). ``([], [])`` for any other node."""
    args = node.args
    if node.target is COND:
        return [args[1], args[2]], list(args[3])
    if node.target is WHILE_LOOP:  # (cond, body, carried inputs, additional inputs)
        return [args[0], args[1]], [*args[2], *args[3]]
    if node.target is MAP:  # (body, mapped tensors, other inputs)
        return [args[0]], [*args[1], *args[2]]
    if node.target is SET_GRAD:  # (enabled, body, *operands)
        return [args[1]], list(args[2:])
    if node.target is AUTOCAST:  # (device, dtype, enabled, cache, body, *operands)
        return [args[4]], list(args[5:])
    if node.target is INVOKE_SUBGRAPH:  # (body, identifier, *operands); a body may be shared
        return [args[0]], list(args[2:])
    return [], []


def with_operands(node: Node, operands: list) -> tuple:
    """``node``'s arguments with ``operands`` (as ``bodies_and_operands`` lists them) in
    place of its own, for cond, while_loop, map and set_grad_enabled."""
    args = node.args
    if node.target is COND:
        return (*args[:3], type(args[3])(operands))
    if node.target is WHILE_LOOP:
        carried = len(args[2])
        return (*args[:2], type(args[2])(operands[:carried]), type(args[3])(operands[carried:]))
    if node.target is MAP:
        mapped = len(args[1])
        return (args[0], type(args[1])(operands[:mapped]), type(args[2])(operands[mapped:]))
    if node.target is SET_GRAD:
        return (*args[:2], *operands)
    raise ValueError(f"{node.format_node()}: not a higher-order op whose operands fx16 sets")


def nested_graph_modules(graph_module) -> list:
    """``graph_module`` and the bodies of its higher-order ops, nested ones too (a body
    that several ops share, once)."""
    found, pending = [], [graph_module]
    while pending:
        module = pending.pop()
        if any(module is seen for seen in found):
            continue
        found.append(module)
        for node in higher_order_nodes(module.graph):
            pending.extend(getattr(module, body.target) for body in bodies_and_operands(node)[0])
    return found


def named_graph_modules(graph_module) -> list:
    """``graph_module`` (named "") and each body of its higher-order ops, nested ones
    too, as ``(attribute path, module)``: ``("true_graph_0", ...)``, once each."""
    return [
        (name, module)
        for name, module in graph_module.named_modules()
        if isinstance(module, torch.fx.GraphModule)
    ]


def qualified_name(body: str, name: str) -> str:
    """How reports name a node ``name`` of the graph at ``body`` (``named_graph_modules``):
    ``true_graph_0.add`` in a body, ``add`` in the program's own graph."""
    return f"{body}.{name}" if body else name


HIGHER_ORDER_OPS = (COND, WHILE_LOOP, MAP, SET_GRAD, AUTOCAST, INVOKE_SUBGRAPH)


def higher_order_nodes(graph) -> list[Node]:
    """The nodes of ``graph`` that call an op with bodies, in graph order, found through
    the graph's lookup table (no walk over every node)."""
    found = []
    for op in HIGHER_ORDER_OPS:
        found.extend(graph.find_nodes(op="call_function", target=op, sort=False))
    return sorted(found)


def carried_count(node: Node) -> int:
    """How many of a while_loop's operands are carried from iteration to iteration
    (its body returns them, in the same dtypes); 0 for other nodes."""
    return len(node.args[2]) if node.target is WHILE_LOOP else 0


def attribute(module, target: str):
    """What a ``get_attr`` node's dotted ``target`` names in ``module`` (a body, a constant)."""
    for part in target.split("."):
        module = getattr(module, part)
    return module
