"""Which analyses have run on a graph, and the check a pass makes before it reads them.

An analysis publishes facts in node meta; a pass that reads them and finds none
cannot tell "nothing to report" from "never looked", and a pipeline with the
analysis left out would cast silently what it should have kept. So every fx16
analysis records that it ran (``Analysis.ensures``), and a pass that reads one
states it in ``needs``: torch's ``PassBase.__call__`` calls ``requires`` before
``call``, which raises ``PreconditionError`` naming what is missing.

What a pass rewrites may make an analysis's findings false, so a pass declares which
analyses it leaves true (``preserves``: their classes, or ``ALL`` for a pass that writes
meta only), and the default is none, as in MLIR and LLVM: after each pass the runner
(``fx16.pipelines.run_passes``) forgets every other analysis once a pass changed the
graph (``forget_unpreserved``),
and a later pass that reads one fails ``requires`` until it runs again.
"""

from collections.abc import Iterable

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase

from fx16.errors import PreconditionError

# graph_module.meta key: the class names of the analyses that have run on it
RAN_KEY = "fx16.analyses_run"
# a pass's ``preserves``: it leaves every analysis true (it writes meta only)
ALL = "all"


class Analysis(PassBase):
    """A pass that only reads the graph and publishes facts in meta. ``needs``: the
    analyses whose facts it reads, which must have run first."""

    needs: tuple[type, ...] = ()
    preserves = ALL  # it reads the graph and writes meta: what others found stays true

    def requires(self, graph_module: GraphModule) -> None:
        require(graph_module, type(self).__name__, self.needs)

    def ensures(self, graph_module: GraphModule) -> None:
        graph_module.meta.setdefault(RAN_KEY, set()).add(type(self).__name__)


def require(graph_module: GraphModule, reader: str, needs: Iterable[type]) -> None:
    """``PreconditionError`` unless every analysis in ``needs`` has run on ``graph_module``."""
    ran = graph_module.meta.get(RAN_KEY, set())
    missing = sorted({analysis.__name__ for analysis in needs} - ran)
    if missing:
        raise PreconditionError(
            f"{reader} reads what {', '.join(missing)} finds, and "
            f"{'it has' if len(missing) == 1 else 'they have'} not run on this graph: run "
            f"{'it' if len(missing) == 1 else 'them'} first (fx16.fp16_passes and "
            "fx16.int16_passes list the order), or drop the rule that reads "
            f"{'it' if len(missing) == 1 else 'them'} (fx16.pipelines.without_rules)"
        )


def forget_unpreserved(graph_module: GraphModule, pass_) -> bool:
    """After ``pass_`` ran on ``graph_module``: forget that the analyses it does not
    preserve have run (``pass_.preserves``; a pass that declares nothing preserves
    nothing). Returns whether anything but ``ALL`` was declared, i.e. whether the
    graph's other cached facts are to be dropped too."""
    preserved = getattr(pass_, "preserves", ())
    if preserved == ALL:
        return False
    names = {analysis.__name__ for analysis in preserved}
    ran = graph_module.meta.get(RAN_KEY)
    if ran:  # a new set: a snapshot of the program may hold the old one
        graph_module.meta[RAN_KEY] = {name for name in ran if name in names}
    return True
