"""RecordStatsPass: the program's figures before fx16 changes it, for the report, and
every node's stable id, for the per-node diagnosis."""

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.contracts import ALL
from fx16.program import Program
from fx16.program.node_ids import assign_ids
from fx16.program.stats import BEFORE_KEY, record_stats_before


class RecordStatsPass(PassBase):
    """Record the program's weight bytes, casts and ops before any fx16 pass runs, so
    that the report compares with the program the user gave, on every route (a cast
    function, or the pass lists run by ``PassManager``).

    Reads: the program. Writes: ``graph_module.meta["fx16.before"]`` (a ProgramStats),
    only when absent: a second pipeline on the same program (the int16 one after the
    fp16 one, or a second cast) keeps the first record; and each op node's id
    (``fx16.program.node_ids``) where it has none, so that ``fx16.diagnose`` aligns the cast
    program with the fp32 one whatever the cast rewrites.
    """

    preserves = ALL  # it records the program's figures in meta

    def __init__(self, program: Program) -> None:
        self.program = Program.of(program)

    def call(self, graph_module: GraphModule) -> PassResult:
        if BEFORE_KEY not in graph_module.meta:
            record_stats_before(self.program.ep)
        assign_ids(graph_module)
        return PassResult(graph_module, False)
