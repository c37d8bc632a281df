"""Ranges proven by use: a value that indexes a dimension of size N lies in [-N, N-1].

A program that writes ``cache_position`` into a static cache of 2048 slots, or
reads ``index_select(table, 0, ids)``, fails on any call where the index leaves the
dimension. So in every valid call the index, and each value it is a copy or a
shifted copy of, lies within the dimension: a proven range where nothing tighter is
known. ``index_bounds`` finds those ranges by walking the graph backwards from each
index argument through copies (views, casts between integer types, ``copy_``,
``select``) and shifts by a value of known range (``i = start + offset``).
"""

from collections.abc import Callable

import torch
from torch.fx import Graph, Node

from fx16.ops.int_ops import INDEX_LIST_OPS, INDEXED_DIMENSIONS, INT_DTYPES
from fx16.ops.tables import CAST_OPS, VALUE_PRESERVING_OPS, overloads
from fx16.program.nodes import named_argument, node_val

aten = torch.ops.aten

# single-input ops whose every result element is an element of the input, by position
_COPIES = frozenset(
    op
    for op, positions in VALUE_PRESERVING_OPS.items()
    if positions in ((0,), (1,))
    and op._opname not in {"gather", "index", "index_select", "amax", "amin", "max", "min"}
)
_SHIFTS = overloads("add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar")

# (low, high): a closed integer interval
Bound = tuple[float, float]
Known = Callable[[object], Bound | None]


def index_bounds(graph: Graph, known: Known, size_bound: Callable) -> dict[Node, Bound]:
    """The interval each integer node is confined to by its uses as an index.

    known: the forward range of a node or number, as (low, high), or None.
    size_bound: the largest value an int or SymInt size can take, or None.
    A node used as several indices gets the intersection of their bounds.
    """
    bounds: dict[Node, Bound] = {}

    def confine(node, bound: Bound) -> None:
        if not isinstance(node, Node) or not _is_integer(node):
            return
        old = bounds.get(node)
        bounds[node] = bound if old is None else (max(old[0], bound[0]), min(old[1], bound[1]))

    for node in reversed(graph.nodes):
        if node.op != "call_function":
            continue
        for index, bound in _direct_bounds(node, size_bound):
            confine(index, bound)
        bound = bounds.get(node)
        if bound is None:
            continue
        if node.target in _COPIES or (node.target in CAST_OPS and _is_integer(node)):
            source = node.args[VALUE_PRESERVING_OPS.get(node.target, (0,))[0]]
            confine(source, bound)
        elif node.target in _SHIFTS:
            for operand, shifted in _unshifted(node, bound, known):
                confine(operand, shifted)
    return bounds


def _direct_bounds(node: Node, size_bound: Callable) -> list[tuple[Node, Bound]]:
    """(index node, bound) for each index argument ``node`` takes."""
    found = []
    if node.target in INDEXED_DIMENSIONS:
        tensor_position, dim, index_position, negatives = INDEXED_DIMENSIONS[node.target]
        tensor = node_val(node.args[tensor_position])
        dim = named_argument(node, dim) if isinstance(dim, str) else dim
        if isinstance(tensor, torch.Tensor) and isinstance(dim, int) and tensor.dim():
            size = size_bound(tensor.shape[dim])
            index = node.args[index_position] if index_position < len(node.args) else None
            if size is not None:
                found.append((index, (-size * negatives, size - 1)))
    elif node.target in INDEX_LIST_OPS:
        tensor = node_val(node.args[0])
        indices = node.args[1] if len(node.args) > 1 else ()
        for dim, index in enumerate(indices or ()):
            size = size_bound(tensor.shape[dim]) if dim < tensor.dim() else None
            if isinstance(index, Node) and size is not None:
                found.append((index, (-size, size - 1)))
    return found


def _unshifted(node: Node, bound: Bound, known: Known) -> list[tuple[Node, Bound]]:
    """Bounds on the operands of ``y = a + alpha * b`` (or ``a - alpha * b``) from a
    bound on y and the known range of the other operand."""
    a, b = node.args[0], node.args[1]
    alpha = named_argument(node, "alpha")
    sign = -1 if node.target._opname == "sub" else 1
    scale = sign * (alpha if alpha is not None else 1)
    low, high = bound
    found = []
    b_range, a_range = known(b), known(a)
    if b_range is not None:
        shifts = (scale * b_range[0], scale * b_range[1])
        found.append((a, (low - max(shifts), high - min(shifts))))
    if a_range is not None and scale in (1, -1):
        rest = (low - a_range[1], high - a_range[0])
        found.append((b, rest if scale == 1 else (-rest[1], -rest[0])))
    return found


def _is_integer(node: Node) -> bool:
    val = node_val(node)
    return isinstance(val, torch.Tensor) and val.dtype in INT_DTYPES
