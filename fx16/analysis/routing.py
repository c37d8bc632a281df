"""RoutingAnalysis: the ops that choose a route, computed where the policy says.

A mixture of experts routes each token by a top-k over its gate's scores; a greedy
decoder picks its next token by an argmax; a detector keeps its top-k boxes. The
index chosen is valid whatever the precision of the scores (UnsafeIndexAnalysis
does not follow a selection upstream), but 16-bit rounding can change which one
is chosen when two scores are within a rounding of each other. Where routers
compute is the policy's choice (``PrecisionPolicy.routing``):

- "fp32" (the default): the selection (topk, sort, argmax/argmin, max/min along a
  dim, multinomial) whose indices become an index, the ops between it and the
  product that scores the choices (a softmax), and that product itself when it
  costs at most ``ROUTER_SHARE`` of the program's matmul/conv/attention FLOPs (a
  router's gate; not a decoder's vocabulary head). Nothing upstream of the product.
- "16-bit": none.

Reads: ``meta["fx16.unsafe_index"]`` (run UnsafeIndexAnalysis first). Writes:
``node.meta["fx16.router"]``: why (a string), on each router op; absent elsewhere.
"""

import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.facts import Facts
from fx16.analysis.unsafe_index import UnsafeIndexAnalysis
from fx16.analysis.upstream import elementwise_past
from fx16.contracts import Analysis
from fx16.ops.int_ops import SELECTION_OPS
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from fx16.program.cost import flops, is_product
from fx16.program.nodes import node_val

# A product that scores a route stays fp32 only when it costs at most this share of the
# program's product FLOPs.
ROUTER_SHARE = 0.01


class RoutingAnalysis(Analysis):
    """Mark the router ops the policy keeps in fp32 (see the module)."""

    META_KEY = meta.ROUTER
    needs = (UnsafeIndexAnalysis,)

    def __init__(self, program: Program, policy: PrecisionPolicy | None = None) -> None:
        self.program = Program.of(program)
        self.policy = policy or PrecisionPolicy.default()

    def call(self, graph_module: GraphModule) -> PassResult:
        boundaries = Facts.of(graph_module).boundaries
        selections = []
        for module in boundaries.graph_modules:
            for node in module.graph.nodes:
                node.meta.pop(self.META_KEY, None)
                if node.target in SELECTION_OPS and _routes(node, boundaries):
                    selections.append(node)
        if self.policy.routing != "fp32" or not selections:
            return PassResult(graph_module, False)
        ranges = Facts.of(graph_module).float_ranges(self.program)
        total = sum(
            flops(n) for m in boundaries.graph_modules for n in m.graph.nodes if is_product(n)
        )
        for selection in selections:
            chain = elementwise_past(selection, boundaries, ranges.of)
            gates = {
                arg
                for node in (selection, *chain)
                for arg in boundaries.inputs(node)
                if is_product(arg) and flops(arg) <= ROUTER_SHARE * total
            }
            why = f"routes {selection.name} (the policy's routing='fp32')"
            for node in (selection, *chain, *gates):
                node.meta.setdefault(self.META_KEY, why)
        return PassResult(graph_module, False)


# How far downstream of a selection's indices to look for the index they decide.
_LOOKAHEAD = 64


def _routes(selection: Node, boundaries: Boundaries) -> bool:
    """The selection compares floats, and the indices it chooses decide an index
    downstream (directly, or through integer ops: a sort of the expert ids, a
    histogram of them)."""
    values = node_val(selection.args[0]) if selection.args else None
    if not (isinstance(values, torch.Tensor) and values.is_floating_point()):
        return False
    position = SELECTION_OPS[selection.target]
    pending = (
        [selection]
        if position is None
        else [u for u in selection.users if u.target is operator.getitem and u.args[1] == position]
    )
    seen: set[Node] = set()
    while pending and len(seen) < _LOOKAHEAD:
        node = pending.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if meta.flows_into_index(node):
            return True
        pending.extend(boundaries.readers(node))
    return False
