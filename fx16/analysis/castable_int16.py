"""CastableInt16Analysis: the set of integer nodes worth computing in int16."""

from collections import deque

from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.unsafe_index import UnsafeIndexAnalysis
from fx16.analysis.user_reachability import UserReachabilityAnalysis
from fx16.contracts import Analysis
from fx16.ops.int_ops import INT16_COMPUTE_OPS, WIDE_INT_DTYPES
from fx16.program import Program
from fx16.program.nodes import node_dtype, value_scalars


def has_scalar_operand(node: Node) -> bool:
    """An int16 compute op (add/sub/mul) with a Python number operand.

    The Core AI converter cannot run such ops in int16, so they never join the set.
    """
    return node.target in INT16_COMPUTE_OPS and bool(value_scalars(node))


class CastableInt16Analysis(Analysis):
    """Mark the castable set: integer nodes connected to an int16 computation.

    Seeds are integer add/sub/mul with only tensor operands. The set grows from them
    to integer producers and consumers (int32/int64 values only), and stops at
    nodes that flow into an index, that do not depend on a user input, or that are
    add/sub/mul with a scalar operand. Being castable says nothing about value
    ranges: ValueRangeAnalysis and the int16 inserter decide whether a castable
    node really fits.

    Requires: UserReachabilityAnalysis and UnsafeIndexAnalysis have run (else
    ``PreconditionError``). Reads: ``meta["fx16.user_reachable"]`` and
    ``meta["fx16.unsafe_index"]``.
    Writes: ``node.meta["fx16.castable_int16"]`` (bool) on every node.
    """

    META_KEY = meta.CASTABLE_INT16

    needs = (UserReachabilityAnalysis, UnsafeIndexAnalysis)

    def __init__(self, program: Program | None = None) -> None:
        self.program = None if program is None else Program.of(program)

    def call(self, graph_module: GraphModule) -> PassResult:
        def eligible(node: Node) -> bool:
            return (
                node.op in ("placeholder", "call_function")
                and node_dtype(node) in WIDE_INT_DTYPES
                and meta.user_reachable(node)
                and not meta.flows_into_index(node)
                and not has_scalar_operand(node)
            )

        castable = {
            node
            for node in graph_module.graph.nodes
            if node.target in INT16_COMPUTE_OPS
            and eligible(node)
            and all(node_dtype(arg) in WIDE_INT_DTYPES for arg in node.all_input_nodes)
        }
        frontier = deque(castable)
        while frontier:
            node = frontier.popleft()
            for neighbour in (*node.all_input_nodes, *node.users):
                if neighbour not in castable and eligible(neighbour):
                    castable.add(neighbour)
                    frontier.append(neighbour)
        for node in graph_module.graph.nodes:
            node.meta[self.META_KEY] = node in castable
        return PassResult(graph_module, False)
