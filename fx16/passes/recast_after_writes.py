"""RecastAfterWritesPass: a cast fx16 inserted is read where the value it copies was
written last, not before a later write in place."""

from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.passes.each_graph import rewrite_each_graph
from fx16.program.aliases import alias_group
from fx16.program.casts import INSERTED, CastInserter, cast_dtype, is_cast, is_inserted
from fx16.program.nodes import mutated_argument


class RecastAfterWritesPass(PassBase):
    """Give each reader that comes after a write in place its own copy of the value.

    fx16 places a cast right after the value it copies, so that one cast serves every
    reader. Where the program later writes into that value (or a view of it), a reader
    after the write must see the written value; the early cast holds the old one:

    Input graph:  h -> c=to(f32) ; view(h).fill_(7) ; add(c, y)
    Output graph: h -> c=to(f32) ; view(h).fill_(7) ; c2=to(f32, h) ; add(c2, y)

    Readers between the same two writes share one new cast, placed right after the
    last write before them. Writes inside a higher-order op's body are not looked at
    (torch.export refuses bodies that write into their operands). Runs on every body.
    Reads: ``meta["fx16.inserted"]``, op schemas. Writes: new casts, rewired readers.
    """

    def call(self, graph_module: GraphModule) -> PassResult:
        return rewrite_each_graph(graph_module, _recast)


def _recast(module: GraphModule) -> bool:
    graph = module.graph
    nodes = list(graph.nodes)
    if not any(node.op == "call_function" and mutated_argument(node) is not None for node in nodes):
        return False  # a functional graph (most exports): nothing is written after a cast
    casts = [node for node in nodes if is_inserted(node) and is_cast(node)]
    if not casts:
        return False
    position = {node: index for index, node in enumerate(nodes)}
    inserter = CastInserter(graph)
    modified = False
    for cast in casts:
        group = alias_group([cast.args[0]])
        writes = sorted(
            position[user]
            for member in group
            for user in member.users
            if user.graph is graph and mutated_argument(user) in group
        )
        later = [w for w in writes if w > position[cast]]
        if not later:
            continue
        recast: dict[int, Node] = {}  # by the last write before a reader
        for reader in list(cast.users):
            before = [w for w in later if w < position[reader]]
            if not before:
                continue
            anchor = before[-1]
            if anchor not in recast:
                recast[anchor] = inserter.cast_placed_after(
                    nodes[anchor], cast.args[0], cast_dtype(cast), cast.meta[INSERTED]
                )
            reader.replace_input_with(cast, recast[anchor])
            modified = True
    return modified
