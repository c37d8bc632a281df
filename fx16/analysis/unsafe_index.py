"""UnsafeIndexAnalysis: which nodes' values end up as indices."""

import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.facts import Facts
from fx16.contracts import Analysis
from fx16.ops.int_ops import INDEX_ARGUMENTS, SELECTION_OPS
from fx16.program.cost import is_product
from fx16.program.nodes import node_val


class UnsafeIndexAnalysis(Analysis):
    """Mark every node whose exact value decides an index, along any path.

    Index arguments are listed in ``fx16.ops.int_ops.INDEX_ARGUMENTS``: embedding ids,
    gather/scatter/index_* indices, ``index.Tensor`` index lists, one_hot,
    nll_loss/cross_entropy targets, and tensors read as Python sizes (``item()``,
    ``repeat_interleave`` counts). Narrowing such a value could send it out of range
    and read the wrong element, so it keeps its dtype; a float that becomes one
    (``to(int)``, floor/round, bucketize, a comparison) keeps its precision. The op
    taking the index is not marked itself (its other inputs may still be narrowed).

    The walk upstream stops at two kinds of node:

    - the indices of a selection (topk, sort, argmax/argmin, max/min along a dim,
      multinomial): they are valid whatever the precision of the values compared,
      which only changes which index is chosen (a router's expert, a decoded token);
    - a matrix product, convolution or attention of floats: the model's real work,
      read as it is computed (its result is marked, the product itself is not).

    Values cross the boundaries of higher-order ops (cond, while_loop, map,
    autocast and set_grad_enabled regions, invoke_subgraph) both ways
    (``fx16.program.boundaries``): an operand that becomes an index inside a body is marked
    outside, a body's result that becomes one outside is marked inside, and so is a
    value a loop carries into the step that uses it as one.

    Reads: the graph only. Writes: ``node.meta["fx16.unsafe_index"]`` (bool) on every
    node, subgraphs included.
    """

    META_KEY = meta.UNSAFE_INDEX

    def call(self, graph_module: GraphModule) -> PassResult:
        boundaries = Facts.of(graph_module).boundaries
        pending: list[Node] = []
        for module in boundaries.graph_modules:
            for node in module.graph.nodes:
                for position in INDEX_ARGUMENTS.get(node.target, ()):
                    if position < len(node.args):
                        map_arg(node.args[position], pending.append)
        unsafe: set[Node] = set()
        while pending:
            node = pending.pop()
            if node in unsafe or _is_float_product(node):
                continue
            unsafe.add(node)
            if not _selected_indices(node):
                pending.extend(boundaries.inputs(node))
        for module in boundaries.graph_modules:
            for node in module.graph.nodes:
                node.meta[self.META_KEY] = node in unsafe
        return PassResult(graph_module, False)


def _selected_indices(node: Node) -> bool:
    """``node`` holds the indices a selection op chose."""
    if node.target in SELECTION_OPS and SELECTION_OPS[node.target] is None:
        return True
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        source = node.args[0]
        return source.target in SELECTION_OPS and SELECTION_OPS[source.target] == node.args[1]
    return False


def _is_float_product(node: Node) -> bool:
    val = node_val(node)
    return isinstance(val, torch.Tensor) and val.is_floating_point() and is_product(node)
