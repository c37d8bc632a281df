"""Which analyses have run on a graph, and the check a pass makes before it reads them.

An analysis publishes facts in node meta; a pass that reads them and finds none
cannot tell "nothing to report" from "never looked", and a pipeline with the
analysis left out would cast silently what it should have kept. So every fx16
analysis records that it ran (``Analysis.ensures``), and a pass that reads one
states it in ``needs``: torch's ``PassBase.__call__`` calls ``requires`` before
``call``, which raises ``PreconditionError`` naming what is missing.
"""

from collections.abc import Iterable

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase

from fx16.errors import PreconditionError

# graph_module.meta key: the class names of the analyses that have run on it
RAN_KEY = "fx16.analyses_run"


class Analysis(PassBase):
    """A pass that only reads the graph and publishes facts in meta. ``needs``: the
    analyses whose facts it reads, which must have run first."""

    needs: tuple[type, ...] = ()

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
