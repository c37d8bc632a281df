"""PreserveCopiesPass: the model's dtype conversions keep copying (or aliasing) once
the cast changes the dtypes around them."""

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.passes.each_graph import rewrite_each_graph
from fx16.program.aliases import written_in_place
from fx16.program.casts import is_cast
from fx16.program.nodes import node_dtype

aten = torch.ops.aten

# Conversions that return their input itself when it already has the dtype asked for.
_MAY_ALIAS = (aten.to.dtype, aten.to.dtype_layout, aten.type_as.default)


class PreserveCopiesPass(PassBase):
    """Pin whether each dtype conversion written through in place copies or aliases.

    ``x.to(torch.float16)`` on an fp32 ``x`` copies; once the cast makes ``x`` fp16,
    the same ``aten.to.dtype`` returns ``x`` itself, and a later ``y.add_(1)`` writes
    into ``x``. Where a write in place reaches the conversion's result or its source
    (``fx16.program.aliases``), this pass states the program's meaning before anything else
    changes a dtype:

    Input graph:  x:f32 -> to.dtype(f16) -> add_        (a copy)
    Output graph: x:f32 -> _to_copy(f16) -> add_        (a copy whatever x becomes)

    Input graph:  x:f32 -> to.dtype(f32) -> add_        (x itself, written through)
    Output graph: x:f32 -> alias -> add_                (x itself whatever x becomes)

    ``type_as`` is handled like ``to``. A conversion nothing writes through is left as
    it is: there copy and alias compute the same values. Runs on every body too.
    Reads: the graph and op schemas. Writes: the replaced nodes (their ``meta`` kept).
    """

    def call(self, graph_module: GraphModule) -> PassResult:
        return rewrite_each_graph(graph_module, _pin_written_conversions)


def _pin_written_conversions(module: GraphModule) -> bool:
    changed = False
    for target in _MAY_ALIAS:
        for node in module.graph.find_nodes(op="call_function", target=target):
            if _converts_dtype_only(node) and written_in_place(node, node.args[0]):
                _pin(node)
                changed = True
    return changed


def _converts_dtype_only(node: Node) -> bool:
    if node.target is aten.type_as.default:
        source = node.args[0]
        return isinstance(source, Node) and isinstance(node_dtype(source), torch.dtype)
    return is_cast(node)


def _pin(node: Node) -> None:
    """Replace ``node`` by ``_to_copy`` where it copies, by ``alias`` where it does not."""
    source = node.args[0]
    dtype = node_dtype(node)
    graph = node.graph
    with graph.inserting_before(node):
        if dtype == node_dtype(source):
            pinned = graph.call_function(aten.alias.default, (source,))
        else:
            pinned = graph.call_function(aten._to_copy.default, (source,), {"dtype": dtype})
    pinned.meta.update(node.meta)  # its value, provenance and id
    node.replace_all_uses_with(pinned)
    graph.erase_node(node)
