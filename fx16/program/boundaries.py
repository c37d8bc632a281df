"""Where a value crosses a higher-order op's boundary: one map every analysis reads.

torch.export keeps control flow and regions as higher-order ops whose bodies are
GraphModules. A value crosses into a body as an operand that becomes the body's
placeholder; out of it as a body output that becomes the op's result (read
through ``getitem``); and around a ``while_loop`` as a carried value: the body's
output i is placeholder i of the next iteration (of the body and of the
condition), and result i once the loop ends (the operand itself when it runs no
iteration). ``Boundaries`` records every such pair, across a program's whole tree
of bodies, so that a fact about a value - a mark, a range, an observation, a
verdict - follows the value wherever it goes: walks upstream go from a body's
placeholder to the operand outside and from a result into the body; facts about
an operand hold on the placeholders it feeds.

A body shared by several call sites (``invoke_subgraph``) is linked to each: its
placeholder holds the operands of all of them.
"""

import operator
from collections import defaultdict

from torch.fx import GraphModule, Node

from fx16.program.subgraphs import (
    WHILE_LOOP,
    bodies_and_operands,
    carried_count,
    nested_graph_modules,
)


class Boundaries:
    """The values that cross the boundaries of the higher-order ops fx16 looks into,
    for ``root`` and every body nested in it."""

    def __init__(self, root: GraphModule, graph_modules: list[GraphModule] | None = None) -> None:
        """``graph_modules``: ``root`` and its nested bodies, when already found."""
        self.graph_modules = graph_modules or nested_graph_modules(root)
        self.looked_into: set[Node] = set()  # the higher-order op nodes whose bodies are linked
        self._sources: dict[Node, list[Node]] = defaultdict(list)
        self._sinks: dict[Node, list[Node]] = defaultdict(list)
        for module in self.graph_modules:
            for node in module.graph.nodes:
                body_nodes, operands = bodies_and_operands(node)
                if body_nodes:
                    bodies = [getattr(module, body.target) for body in body_nodes]
                    self._link_op(node, bodies, operands)

    def _link(self, source: Node, sink: Node) -> None:
        if isinstance(source, Node) and isinstance(sink, Node):
            self._sources[sink].append(source)
            self._sinks[source].append(sink)

    def _link_op(self, node: Node, bodies: list[GraphModule], operands: list) -> None:
        self.looked_into.add(node)
        results = {
            user.args[1]: user
            for user in node.users
            if user.target is operator.getitem and isinstance(user.args[1], int)
        }
        carried = carried_count(node)
        loop_body = bodies[-1] if node.target is WHILE_LOOP else None
        placeholders = [body.graph.find_nodes(op="placeholder") for body in bodies]
        for body_placeholders in placeholders:
            for placeholder, operand in zip(body_placeholders, operands):
                self._link(operand, placeholder)
        for body in bodies:
            if loop_body is not None and body is not loop_body:
                continue  # a loop's condition returns the predicate, not a result
            outputs = _outputs(body)
            for index, output in enumerate(outputs):
                if index in results:
                    self._link(output, results[index])
            for index, output in enumerate(outputs[:carried]):
                for each in placeholders:  # the next iteration's body and condition
                    self._link(output, each[index])
        for index in range(carried):  # a loop that runs no iteration returns its operands
            if index in results:
                self._link(operands[index], results[index])

    def crossing_sources(self, node: Node) -> list[Node]:
        """The nodes in other graphs whose value ``node`` holds: for a body's placeholder,
        the operands fed to it (and, carried by a loop, the body's output); for a
        higher-order op's result, the bodies' outputs. Empty for other nodes."""
        return self._sources.get(node, [])

    def crossing_sinks(self, node: Node) -> list[Node]:
        """The nodes in other graphs that hold ``node``'s value (the inverse of
        ``crossing_sources``)."""
        return self._sinks.get(node, [])

    def inputs(self, node: Node) -> list[Node]:
        """The values ``node``'s value is computed from, across boundaries: a body's
        placeholder reads the operands fed to it, a result of a higher-order op the
        outputs of its bodies; a higher-order op fx16 looks into reads nothing itself
        (its results do); any other node reads its inputs (bodies' ``get_attr`` left out)."""
        if node in self._sources:
            return self._sources[node]
        if node in self.looked_into or node.op == "placeholder":
            return []
        return [arg for arg in node.all_input_nodes if arg.op != "get_attr"]

    def readers(self, node: Node) -> list[Node]:
        """The nodes that read ``node``'s value, across boundaries: its users, with a
        higher-order op fx16 looks into replaced by the placeholders its value becomes,
        and a body's output replaced by the op's results."""
        users = [user for user in node.users if user not in self.looked_into]
        return users + self.crossing_sinks(node)


def _outputs(body: GraphModule) -> list:
    returned = body.graph.output_node().args[0]
    return list(returned) if isinstance(returned, (list, tuple)) else [returned]
