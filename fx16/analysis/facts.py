"""One table of facts per graph, shared by every analysis and rule, and dropped on rewrite.

The analyses of a cast all ask the same questions of the same graph: which graph
modules the program's bodies are (``nested_graph_modules``), where values cross a
higher-order op's boundary (``Boundaries``), what range a float value is known to
lie in (``FloatRanges``), in which order the nodes come. Each answer is computed
once, on first use, and kept in the graph module's ``Facts`` until a pass rewrites
the graph: a pass that adds, removes or rewires nodes calls ``Facts.invalidate``
(as an LLVM or MLIR pass declares which analyses it preserves). Analyses read and
write meta only, so the facts they share stay valid from the first analysis to the
first rewrite.

A pass written elsewhere may not know to invalidate: the table is also dropped when
a graph's node count or graph object changed since it was built.

Reads: the graph modules' structure. Writes: nothing on the graph; the table lives
beside the graph module (not in its meta: a copy of the program builds its own).
"""

import weakref
from functools import cached_property

from torch.fx import GraphModule, Node

from fx16.program.boundaries import Boundaries
from fx16.program.subgraphs import nested_graph_modules


class Facts:
    """What every analysis of ``root`` reads, computed once (see the module docstring)."""

    def __init__(self, root: GraphModule) -> None:
        self.root = root
        self.fingerprint = _fingerprint(root)
        self._float_ranges = None
        self._float_ranges_read_value_ranges = False
        self._derived: dict[str, object] = {}

    @classmethod
    def of(cls, root: GraphModule) -> "Facts":
        """The facts of ``root``: the table built earlier if the graph has not changed
        since, else a new one."""
        facts = _TABLES.get(root)
        if facts is None or facts.fingerprint != _fingerprint(root):
            facts = _TABLES[root] = cls(root)
        return facts

    @staticmethod
    def invalidate(root: GraphModule) -> None:
        """Drop the facts of ``root``: call after rewriting its graph or a body's."""
        _TABLES.pop(root, None)

    def derived(self, key: str, compute):
        """``compute()``, once per table: a fact one module derives from the graph's
        structure alone (the fp32 regions a model opens), dropped with the table."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    @cached_property
    def graph_modules(self) -> list[GraphModule]:
        """``root`` and the bodies of its higher-order ops, nested ones too."""
        return nested_graph_modules(self.root)

    @cached_property
    def boundaries(self) -> Boundaries:
        """Where values cross into and out of the bodies (``fx16.program.boundaries``)."""
        return Boundaries(self.root, self.graph_modules)

    @cached_property
    def positions(self) -> dict[Node, int]:
        """Each node's place in its graph (nodes of different graphs do not compare)."""
        return {
            node: index
            for module in self.graph_modules
            for index, node in enumerate(module.graph.nodes)
        }

    def float_ranges(self, program):
        """The proven float ranges (``fx16.analysis.float_range.FloatRanges``), shared
        by the analyses that read them: each value's range is derived once."""
        from fx16.analysis.float_range import FloatRanges  # it reads the facts too
        from fx16.contracts import RAN_KEY

        # the integer ranges they start from: computed anew once that analysis has run
        read_value_ranges = "ValueRangeAnalysis" in self.root.meta.get(RAN_KEY, ())
        if self._float_ranges is None or read_value_ranges != self._float_ranges_read_value_ranges:
            self._float_ranges = FloatRanges(program, self.boundaries)
            self._float_ranges_read_value_ranges = read_value_ranges
        return self._float_ranges


_TABLES: "weakref.WeakKeyDictionary[GraphModule, Facts]" = weakref.WeakKeyDictionary()


def _fingerprint(root: GraphModule) -> tuple[int, int]:
    """What a rewrite that forgot to invalidate most likely changed."""
    return id(root.graph), len(root.graph.nodes)
