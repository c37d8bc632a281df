"""Does rounding a few more values change anything after them? A replay of the emulation
that follows the difference forward until it vanishes.

``VerdictCheckAnalysis`` asks whether an fp32 verdict pays for itself by running the
emulated program twice. Often the answer is already clear near the verdict's nodes:
a written-out GELU's cube kept in fp32 is rounded by the cast before the 16-bit multiply
that reads it, and everything after computes the same bits either way. The replay computes,
for one call, each value the difference reaches both ways (with the verdict, and
without it) and, once, what those values depend on, in execution order, until every
path has reconverged: then the outputs are identical and no whole run is needed.

It follows values into the bodies of regions that run once as they are (autocast
disabled, ``set_grad_enabled``), through ``fx16.program.boundaries``. It gives up - the
caller measures instead - when a difference reaches an output, a loop or branch, or
an in-place op, or when it would compute more than ``LOCAL_SHARE`` of the program's
nodes (both ways counted).
"""

import heapq

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from fx16.analysis.facts import Facts
from fx16.program import narrow_reads
from fx16.program.interpreter import widened_dtype
from fx16.program.nodes import mutated_argument
from fx16.program.subgraphs import AUTOCAST, SET_GRAD, attribute, bodies_and_operands

# The most of the program a replay computes (both ways counted) before it gives up: a
# twentieth of a run, so that a replay that fails costs little next to the runs it saves.
LOCAL_SHARE = 0.05
LEAST_BUDGET = 32  # computations, however small the program


def replay_reconverges(emulation, graph_inputs: list, wide: set[Node], dropped: set[Node]) -> bool:
    """For one call (``graph_inputs``): whether rounding ``dropped`` as well as what the
    emulation rounds with ``wide`` in fp32 leaves every value after them bit-identical."""
    scope = _Scope(emulation.program.graph_module)
    if not all(node in scope.position for node in dropped):
        return False
    placeholders = emulation.program.graph_module.graph.find_nodes(op="placeholder")
    replay = _Replay(emulation, scope, dict(zip(placeholders, graph_inputs)), wide)
    try:
        return replay.reconverges(dropped)
    except _TooFar:
        return False


class _TooFar(Exception):
    """The replay would cost more than a run, or meets what it does not replay."""


class _Scope:
    """The nodes a replay follows values through - the program's graph and the bodies of
    its regions that run once as they are - in execution order, and where each crosses."""

    def __init__(self, root: GraphModule) -> None:
        self.root = root
        self.boundaries = Facts.of(root).boundaries
        self.position: dict[Node, int] = {}
        self.module: dict[Node, GraphModule] = {}  # the graph module a node is in
        self._take(root)

    def _take(self, module: GraphModule) -> None:
        for node in module.graph.nodes:
            self.position[node] = len(self.position)
            self.module[node] = module
            if node.target is SET_GRAD or (node.target is AUTOCAST and not node.args[2]):
                self._take(attribute(module, bodies_and_operands(node)[0][0].target))

    def inputs(self, node: Node) -> list[Node]:
        """What ``node``'s value is computed from (across a region's boundary: the one
        value it holds)."""
        sources = self.boundaries.crossing_sources(node)
        if sources:
            if len(sources) != 1:
                raise _TooFar  # a loop's carried value, a branch's two outputs
            return sources
        return list(node.all_input_nodes)

    def readers(self, node: Node) -> list[Node]:
        """The nodes that read ``node``'s value (a region's output: the op's results)."""
        return [
            user
            for user in self.boundaries.readers(node)
            if not (user.op == "output" and user.graph is not self.root.graph)
        ]


class _Replay:
    """One call's values, computed on demand as the emulation computes them with ``wide``
    in fp32 (``kept``); and the ones that differ with ``dropped`` rounded too."""

    def __init__(self, emulation, scope: _Scope, inputs: dict, wide: set[Node]) -> None:
        self.emulation, self.scope, self.inputs, self.wide = emulation, scope, inputs, wide
        self.budget = max(LEAST_BUDGET, LOCAL_SHARE * len(scope.position))
        self.computations = 0
        self.kept: dict[Node, object] = {}

    def reconverges(self, dropped: set[Node]) -> bool:
        position = self.scope.position
        changed: dict[Node, object] = {}  # the values that differ once ``dropped`` rounds
        pending = [(position[node], node) for node in dropped]
        heapq.heapify(pending)
        seen = set(dropped)
        while pending:
            _, node = heapq.heappop(pending)
            if node not in position or node.op == "output" or _opaque(node):
                return False
            values = {arg: changed.get(arg, self.value(arg)) for arg in self.scope.inputs(node)}
            rounds = node in self.emulation.rounding and (node not in self.wide or node in dropped)
            other = self.computed(node, values, rounds, self.wide - dropped)
            if _identical(self.value(node), other):
                continue  # reconverged here
            changed[node] = other
            for reader in self.scope.readers(node):
                if reader not in seen:
                    seen.add(reader)
                    heapq.heappush(pending, (position.get(reader, -1), reader))
        return True

    def value(self, node: Node):
        """``node``'s value with ``wide`` in fp32, computing what it needs first."""
        stack = [node]
        while stack:
            top = stack[-1]
            if top in self.kept:
                stack.pop()
                continue
            missing = [arg for arg in self.scope.inputs(top) if arg not in self.kept]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            if top not in self.scope.position or _opaque(top):
                raise _TooFar
            rounds = top in self.emulation.rounding and top not in self.wide
            self.kept[top] = self.computed(top, self.kept, rounds, self.wide)
        return self.kept[node]

    def computed(self, node: Node, values: dict, rounds: bool, wide: set[Node]):
        """``node``'s value from its inputs' ``values``, rounded as the emulation would
        with ``wide`` kept in fp32 (what it reads of them rounded too, where it rounds)."""
        self.computations += 1
        if self.computations > self.budget:
            raise _TooFar
        sources = self.scope.boundaries.crossing_sources(node)
        if sources:
            value = values[sources[0]]
        elif node.op == "placeholder":
            value = self.inputs[node]  # as handed: narrower where the graph widens it
        elif node.op == "get_attr":
            value = attribute(self.scope.module[node], node.target)
        else:
            by_blocks = node.target in narrow_reads.READERS
            from_wide = self.emulation.reads_rounded(node, wide) if rounds else []

            def read(arg: Node):
                found = values[arg]
                dtype = widened_dtype(arg, found) if arg.op == "placeholder" else None
                found = narrow_reads.as_read(found, dtype, by_blocks)
                return self.emulation.rounded(arg, found) if arg in from_wide else found

            args, kwargs = map_arg((node.args, node.kwargs), read)
            value = narrow_reads.call(node.target, args, kwargs)
        return self.emulation.rounded(node, value) if rounds else value


def _opaque(node: Node) -> bool:
    """A node the replay does not run: a higher-order op (its results come from its
    bodies' outputs), an op that writes its input in place (both ways would share it)."""
    if node.op != "call_function":
        return False
    return bool(bodies_and_operands(node)[0]) or mutated_argument(node) is not None


def _identical(a, b) -> bool:
    """Bit-identical values (a nan anywhere counts as a difference)."""
    if a is b:
        return True
    leaves_a, leaves_b = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(leaves_a) != len(leaves_b):
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x is not y and x != y:
            return False
    return True
