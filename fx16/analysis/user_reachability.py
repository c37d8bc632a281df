"""UserReachabilityAnalysis: which nodes depend on a user input."""

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.contracts import Analysis
from fx16.program import Program


class UserReachabilityAnalysis(Analysis):
    """Mark every node with whether its value depends on a user input.

    Reads: the program's signature (which placeholders are user inputs).
    Writes: ``node.meta["fx16.user_reachable"]`` (bool) on every node. A node that
    does not depend on a user input is constant-foldable: converters fold it, and
    narrowing it gains nothing.
    """

    META_KEY = meta.USER_REACHABLE

    def __init__(self, program: Program) -> None:
        self.program = Program.of(program)

    def call(self, graph_module: GraphModule) -> PassResult:
        reachable = set(self.program.user_input_placeholders())
        for node in graph_module.graph.nodes:  # nodes are in topological order
            if node not in reachable and any(arg in reachable for arg in node.all_input_nodes):
                reachable.add(node)
            node.meta[self.META_KEY] = node in reachable
        return PassResult(graph_module, False)
