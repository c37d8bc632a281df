"""PreserveCopiesPass: the model's dtype conversions keep copying (or aliasing) once
the cast changes the dtypes around them."""

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.passes.each_graph import rewrite_each_graph
from fx16.program.aliases import boundary_readers, written_in_place
from fx16.program.casts import is_cast
from fx16.program.nodes import node_dtype

aten = torch.ops.aten

# Conversions that return their input itself when it already has the dtype asked for.
_MAY_ALIAS = (aten.to.dtype, aten.to.dtype_layout, aten.type_as.default)


class PreserveCopiesPass(PassBase):
    """Pin whether a dtype conversion copies or aliases where the difference shows: a
    write in place reaches it, or (a copy) it crosses into or out of a body.

    ``x.to(torch.float16)`` on an fp32 ``x`` copies; once the cast makes ``x`` fp16,
    the same ``aten.to.dtype`` returns ``x`` itself, and a later ``y.add_(1)`` writes
    into ``x``. Where a write in place reaches the conversion's result or its source
    (``fx16.program.aliases``), this pass states the program's meaning before anything else
    changes a dtype:

    Input graph:  x:f32 -> to.dtype(f16) -> add_        (a copy)
    Output graph: x:f32 -> _to_copy(f16) -> add_        (a copy whatever x becomes)

    Input graph:  x:f32 -> to.dtype(f32) -> add_        (x itself, written through)
    Output graph: x:f32 -> alias -> add_                (x itself whatever x becomes)

    A conversion that copies is pinned as well where a higher-order op reads its result
    (or a view of it) or a body returns it: torch refuses operands that alias each other
    and a body output that aliases its input or another output, so
    ``cond(x.half(), x.half())`` must stay two copies once x is fp16.

    ``type_as`` is handled like ``to``. A conversion nothing writes through, and no
    higher-order op or body output reads, is left as it is: there copy and alias
    compute the same values. Runs on every body too.
    Reads: the graph and op schemas. Writes: the replaced nodes (their ``meta`` kept).
    """

    def call(self, graph_module: GraphModule) -> PassResult:
        return rewrite_each_graph(
            graph_module,
            lambda module: _pin_conversions(module, graph_module.graph),
        )


def _pin_conversions(module: GraphModule, top: Graph) -> bool:
    changed = False
    for target in _MAY_ALIAS:
        for node in module.graph.find_nodes(op="call_function", target=target):
            if _converts_dtype_only(node) and (
                written_in_place(node, node.args[0]) or _copy_across_a_boundary(node, top)
            ):
                _pin(node)
                changed = True
    return changed


def pinned_across_a_boundary(node: Node) -> bool:
    """Whether this pass pins ``node`` (as ``_to_copy``) once a higher-order op reads it
    or a body returns it: a dtype conversion that may alias."""
    return node.target in _MAY_ALIAS and _converts_dtype_only(node)


def _copy_across_a_boundary(node: Node, top: Graph) -> bool:
    """``node`` copies (it changes the dtype), and a higher-order op reads its result or
    a body returns it (``boundary_readers``; ``top``: the program's graph). A
    conversion that aliases may become a copy: that never aliases anything."""
    return node_dtype(node) != node_dtype(node.args[0]) and bool(boundary_readers(node, top))


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
