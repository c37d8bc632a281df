"""Repairs of what torch.export leaves inconsistent in a graph, made before fx16
changes it (``Program`` makes them once per program)."""

from torch.fx import GraphModule


def register_missing_users(graph_module: GraphModule) -> None:
    """List every node among the users of the nodes it reads.

    torch.export can leave a dead node of an autocast-split graph out of its input's
    ``users`` (seen with torch 2.13); rewriting that node's arguments then fails inside
    FX with a SystemError. Registering it restores the invariant FX relies on."""
    for module in graph_module.modules():
        if isinstance(module, GraphModule):
            for node in module.graph.nodes:
                for arg in node.all_input_nodes:
                    if node not in arg.users:
                        arg.users[node] = None


def unshare_meta(graph_module: GraphModule) -> None:
    """Give every node a meta dict of its own.

    torch.export can hand a body's output node and the getitem that reads it outside
    the same meta dict (seen with torch 2.13's non-strict export of a
    ``torch.no_grad()`` region); a decision recorded for one would then land on both."""
    seen: set[int] = set()
    for module in graph_module.modules():
        if isinstance(module, GraphModule):
            for node in module.graph.nodes:
                if id(node.meta) in seen:
                    node.meta = dict(node.meta)
                seen.add(id(node.meta))
