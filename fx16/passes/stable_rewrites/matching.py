"""What the stable rewrites share: matching a pattern, building its replacement, and the
power of two below a value that the scaled rewrites divide by."""

from dataclasses import dataclass
from typing import Protocol

import torch
from torch.fx import Graph, Node

from fx16.meta import BOUNDED_BELOW, ROUNDING_CANCELS
from fx16.program.casts import copy_provenance
from fx16.program.nodes import is_number
from fx16.program.propagation import fresh_result

aten = torch.ops.aten


def calls(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def only_user(node: Node, user: Node) -> bool:
    return len(node.users) == 1 and user in node.users


def is_scalar(value, expected: float) -> bool:
    return is_number(value) and value == expected


def squared(node) -> Node | None:
    """x for ``pow(x, 2)`` or ``x * x``."""
    if calls(node, aten.pow.Tensor_Scalar) and is_scalar(node.args[1], 2):
        return node.args[0]
    if calls(node, aten.mul.Tensor) and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def mean_of(node) -> tuple[Node, list, bool] | None:
    """(x, dims, keepdim) for ``mean(x, dims, keepdim)``."""
    if calls(node, aten.mean.dim) and isinstance(node.args[0], Node):
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return node.args[0], list(node.args[1]), bool(keepdim)
    return None


class Builder:
    """Makes the replacement's nodes before ``anchor``, each with its fake value and the
    anchor's provenance (module path, source line)."""

    def __init__(self, graph: Graph, anchor: Node) -> None:
        self.graph, self.anchor = graph, anchor

    def __call__(self, target, *args, **kwargs) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target)
        # its arguments given once it is made: ``create_node`` walks them with pytree to
        # warn of raw SymInts, which no rewrite passes (a norm's rewrite makes ~120 nodes)
        node.args = args
        if kwargs:
            node.kwargs = kwargs
        node.meta["val"] = fresh_result(node)  # every op it makes computes a new tensor
        copy_provenance(self.anchor, node)
        return node


@dataclass(frozen=True)
class Rewrite:
    """What a rule found: the node whose result it replaces, the nodes only that
    result used (removed with it), and how to build the replacement."""

    result: Node
    replaced: tuple[Node, ...]
    detail: str = ""
    parts: tuple = ()  # what the rule's build reads, where the match found it
    in_model_fp32: bool = False  # the result is in an fp32 region the model opens itself


class StableRewrite(Protocol):
    """A rule of ``StabilizePass``: ``name`` (what the report's ``stabilized`` says),
    ``roots`` (the ops its matches start from), ``marks`` (the meta markers its
    replacement writes: what the later analyses may read of it), ``match`` (a
    ``Rewrite``, or None where the pattern is not there) and ``build`` (the node giving
    the pattern's result, made with a ``Builder``). Its docstring shows the pattern
    before and after, and what it costs: the rules page prints it."""

    name: str
    roots: tuple
    marks: tuple[str, ...]

    def match(self, node: Node) -> Rewrite | None: ...

    def build(self, graph: Graph, rewrite: Rewrite) -> Node: ...


def reduction_of(node) -> tuple[Node, list, bool, object] | None:
    """(x, dims, keepdim, op) for ``mean(x, dims, keepdim)`` or ``sum(x, dims, keepdim)``."""
    if calls(node, aten.sum.dim_IntList) and isinstance(node.args[0], Node):
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if node.kwargs.get("dtype") is None and (len(node.args) < 4 or node.args[3] is None):
            return node.args[0], list(node.args[1]), bool(keepdim), node.target
        return None
    found = mean_of(node)
    return None if found is None else (*found, node.target)


def power_of_two_below(
    make: Builder, largest: Node, parts, why: str, exponent_of=None
) -> tuple[Node, Node]:
    """(k, 2**k) for ``k = floor(log2(largest))`` (or ``exponent_of(make, k)``, a chain of
    nodes that makes another integer of it): a power of two (dividing by it is exact in
    16-bit) within 2x below ``largest``, which the caller keeps at least 16-bit's
    smallest normal (so k is finite where ``largest`` is). Its nodes and ``parts`` (what
    ``largest`` is computed from) say ``why`` their rounding cancels.

    The floor is ``div(log2(largest), 1, rounding_mode="floor")`` and the power
    ``pow(2.0, k)``, exact for an integer k: ops that ExecuTorch's XNNPACK delegate
    leaves out, like ``amax`` and ``log2``, so the whole chain runs outside it in one
    piece (an ``aten.floor``, which XNNPACK takes, made it a one-op delegate call of its
    own), and that ExecuTorch's kernels have (not ``exp2``: a program with one lowers but
    fails to run there)."""
    logarithm = make(aten.log2.default, largest)
    exponent = make(aten.div.Tensor_mode, logarithm, 1.0, rounding_mode="floor")
    chain = [logarithm, exponent]
    if exponent_of is not None:
        exponent = exponent_of(make, exponent)
        chain.extend(made_since(make, exponent, chain[-1]))
    power = make(aten.pow.Scalar, 2.0, exponent)
    for part in (*parts, *chain, power):
        part.meta[ROUNDING_CANCELS] = why
    for bounded in (largest, power):
        bounded.meta[BOUNDED_BELOW] = AT_LEAST_NORMAL
    return exponent, power


def made_since(make: Builder, last: Node, first: Node) -> list[Node]:
    """The nodes ``make`` put in its graph after ``first``, up to and with ``last``."""
    nodes, node = [], last
    while node is not first:
        nodes.append(node)
        node = node.prev
    return nodes


AT_LEAST_NORMAL = "at least 2**-14, 16-bit's smallest normal"
