"""Run a graph rewrite on a program's graph and on every body nested in it."""

from collections.abc import Callable

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from fx16.analysis.facts import Facts
from fx16.program.subgraphs import nested_graph_modules


def rewrite_each_graph(
    graph_module: GraphModule, rewrite: Callable[[GraphModule], bool]
) -> PassResult:
    """``rewrite`` each of ``graph_module`` and its bodies (it says whether it changed
    one); a changed body is recompiled at once (its op runs its code), the root by
    whoever runs the pipeline; the facts are dropped when anything changed."""
    modified = False
    for module in nested_graph_modules(graph_module):
        if rewrite(module):
            modified = True
            if module is not graph_module:
                module.recompile()
    if modified:
        Facts.invalidate(graph_module)
    return PassResult(graph_module, modified)
