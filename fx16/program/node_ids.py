"""Stable node ids: which node of a cast program computes which value of the fp32 one.

A cast renames nothing, but it inserts casts, retargets the model's casts, removes
some, and a program may be saved and loaded in between; names alone would then
mislead an alignment (a loaded program's inserted cast may take a name the fp32
program used). So before the first change, every op node gets an id in
``node.meta["custom"]["fx16_id"]``, which ``torch.export.save`` keeps: the path of
its graph (``true_graph_0.`` for a cond branch, empty for the program's own graph)
and its name. Nodes fx16 inserts get none; a placeholder's id is its name, which
no cast changes (``torch.export.save`` does not keep a placeholder's custom meta),
and a ``getitem``'s its container's id and index (a loaded one carries its
container's custom meta).

An fp32 program that was never cast has no ids: ``node_id`` gives the id it would
get, so the fp32 reference and the cast program align either way.
"""

import operator
from collections.abc import Iterator

from torch.fx import GraphModule, Node

CUSTOM = "custom"  # the node meta key torch.export serializes for users
ID = "fx16_id"


def assign_ids(root: GraphModule) -> None:
    """Give every op node of ``root`` and its bodies that has no id yet its id."""
    for prefix, module in graph_modules(root):
        for node in module.graph.nodes:
            if node.op == "call_function" and ID not in node.meta.get(CUSTOM, {}):
                # a new dict: a transaction's snapshot shares the old one
                node.meta[CUSTOM] = {**node.meta.get(CUSTOM, {}), ID: prefix + node.name}


def node_id(node: Node, prefix: str, assigned: bool) -> str | None:
    """The id of ``node`` (in the graph at ``prefix``): the one assigned before the cast,
    or, in a program without ids (``assigned`` False: never cast by fx16), the one it
    would get. None for a node fx16 inserted (an op without an id in a program with ids)."""
    if node.op == "placeholder":
        return prefix + node.name
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        # by its container: torch.export.load gives a getitem its producer's custom meta
        container = node_id(node.args[0], prefix, assigned)
        return None if container is None else f"{container}[{node.args[1]}]"
    custom = node.meta.get(CUSTOM) or {}
    if ID in custom:
        return custom[ID]
    return None if assigned else prefix + node.name


def has_ids(root: GraphModule) -> bool:
    """fx16 gave ``root``'s nodes their ids (it cast the program, or began to)."""
    return any(
        ID in (node.meta.get(CUSTOM) or {})
        for _, module in graph_modules(root)
        for node in module.graph.nodes
    )


def graph_modules(root: GraphModule) -> Iterator[tuple[str, GraphModule]]:
    """``root`` and each body nested in it, with the prefix of its ids ("" for root)."""
    for name, module in root.named_modules():
        if isinstance(module, GraphModule):
            yield (f"{name}." if name else ""), module
