"""UnsafeIndexAnalysis: which nodes' values end up as indices."""

from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.ops import INDEX_ARGUMENTS
from fx16.subgraphs import bodies_and_operands, carried_count


class UnsafeIndexAnalysis(PassBase):
    """Mark every node whose value flows, along any path, into an index argument.

    Index arguments are listed in ``fx16.ops.INDEX_ARGUMENTS``: embedding ids,
    gather/scatter/index_* indices, ``index.Tensor`` index lists, one_hot,
    nll_loss/cross_entropy targets, and tensors read as Python sizes (``item()``,
    ``repeat_interleave`` counts). Narrowing such a value could send it out of range
    and read the wrong element, so it keeps its dtype. The op taking the index is
    not marked itself (its other inputs may still be narrowed).

    Bodies of higher-order ops (cond, while_loop, map, autocast and set_grad_enabled
    regions) are analysed too, across their boundaries: an operand that becomes an
    index inside a body is marked outside, and a body's results are marked when they
    become indices outside.

    Reads: the graph only. Writes: ``node.meta["fx16.unsafe_index"]`` (bool) on every
    node, subgraphs included.
    """

    META_KEY = "fx16.unsafe_index"

    def call(self, graph_module: GraphModule) -> PassResult:
        _mark(graph_module, unsafe_outputs=False)
        return PassResult(graph_module, False)


def _mark(graph_module: GraphModule, unsafe_outputs: bool) -> list[bool]:
    """Mark the nodes of ``graph_module`` and the bodies of its higher-order ops
    (``unsafe_outputs``: what the graph returns becomes an index outside it).
    Returns, per placeholder, whether it is marked: the operand feeding it is then
    marked in the enclosing graph."""
    graph = graph_module.graph
    unsafe: set[Node] = set(graph.output_node().all_input_nodes) if unsafe_outputs else set()
    for node in reversed(graph.nodes):
        if node in unsafe:
            unsafe.update(node.all_input_nodes)  # every path upstream
        for position in INDEX_ARGUMENTS.get(node.target, ()):
            if position < len(node.args):
                map_arg(node.args[position], unsafe.add)
        body_nodes, operands = bodies_and_operands(node)
        for body in body_nodes:
            submodule = getattr(graph_module, body.target)
            marked = _mark(submodule, unsafe_outputs=node in unsafe)
            if any(marked[: carried_count(node)]):  # an index carried into the next step
                marked = _mark(submodule, unsafe_outputs=True)
            unsafe.update(
                operand
                for operand, flag in zip(operands, marked)
                if flag and isinstance(operand, Node)
            )
    for node in graph.nodes:
        node.meta[UnsafeIndexAnalysis.META_KEY] = node in unsafe
    return [node in unsafe for node in graph.find_nodes(op="placeholder")]
