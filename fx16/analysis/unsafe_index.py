"""UnsafeIndexAnalysis: which nodes' values end up as indices."""

from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.ops import INDEX_ARGUMENTS


class UnsafeIndexAnalysis(PassBase):
    """Mark every node whose value flows, along any path, into an index argument.

    Index arguments are listed in ``fx16.ops.INDEX_ARGUMENTS``: embedding ids,
    gather/scatter/index_* indices, ``index.Tensor`` index lists, one_hot,
    nll_loss/cross_entropy targets, and tensors read as Python sizes (``item()``,
    ``repeat_interleave`` counts). Narrowing such a value could send it out of range
    and read the wrong element, so it keeps its dtype. The op taking the index is
    not marked itself (its other inputs may still be narrowed).

    Reads: the graph only. Writes: ``node.meta["fx16.unsafe_index"]`` (bool) on every node.
    """

    META_KEY = "fx16.unsafe_index"

    def call(self, graph_module: GraphModule) -> PassResult:
        unsafe: set[Node] = set()
        for node in reversed(graph_module.graph.nodes):
            if node in unsafe:
                unsafe.update(node.all_input_nodes)  # every path upstream
            for position in INDEX_ARGUMENTS.get(node.target, ()):
                if position < len(node.args):
                    map_arg(node.args[position], unsafe.add)
        for node in graph_module.graph.nodes:
            node.meta[self.META_KEY] = node in unsafe
        return PassResult(graph_module, False)
