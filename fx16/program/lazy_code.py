"""A graph module whose Python code is generated when it is first needed.

``GraphModule.recompile()`` writes the graph out as Python source and compiles it: about
as long as all of an uncalibrated cast's analyses together. Yet the code of an
``ExportedProgram``'s root module is seldom run: ``ep.module()`` (which
``run_decompositions``, ``torch.compile`` and ExecuTorch's ``to_edge`` go through) builds
a new module from a copy of the graph and compiles that one, and ``torch.export.save``
writes the graph, not the code. torch.fx's ``_LazyGraphModule`` (what inductor's passes
use for the same reason) marks the code stale instead, and generates it the first time
the module is called, its ``code`` read, or the module pickled. ``compile_when_needed``
makes a graph module one, in place: every reference to it sees the change.
"""

from torch.fx import GraphModule

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:  # a torch without it: the code is generated at once
    _LazyGraphModule = None


def compile_when_needed(graph_module: GraphModule) -> None:
    """Mark ``graph_module``'s code stale, to be generated when it is first needed.

    Reads the module's class; writes it (a lazy subclass of its own, as each graph module
    has one) and the class's ``forward``. A module of a class other than torch's own, or a
    torch without lazy graph modules, is recompiled at once.
    """
    if _LazyGraphModule is None or not _made_by_torch(graph_module):
        graph_module.recompile()
        return
    if not isinstance(graph_module, _LazyGraphModule):
        # GraphModule gives each instance a class of its own, "GraphModuleImpl" by its
        # qualified name (its copies find their base by skipping that name): the same,
        # lazy, under the name the module prints with
        lazy = type("GraphModuleImpl", (_LazyGraphModule,), {})
        lazy.__name__ = type(graph_module).__name__
        graph_module.__class__ = lazy
    graph_module.recompile()


def _made_by_torch(graph_module: GraphModule) -> bool:
    """``graph_module``'s class is the per-instance class torch gives a plain (or lazy)
    ``GraphModule``, not a subclass someone wrote."""
    cls = type(graph_module)
    return cls.__qualname__.split(".")[-1] == "GraphModuleImpl" and cls.__bases__ in (
        (GraphModule,),
        (_LazyGraphModule,),
    )
