"""CleanupCastsPass: run the cast-cleanup rules until none applies."""

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.analysis.facts import Facts
from fx16.errors import PassFailedError
from fx16.passes.bypass_branching_casts import BypassBranchingCastsPass
from fx16.passes.cast_rule import CastRule
from fx16.passes.deduplicate_casts import DeduplicateCastsPass
from fx16.passes.fuse_cast_chains import FuseCastChainsPass
from fx16.passes.remove_identity_arithmetic import RemoveIdentityArithmeticPass
from fx16.passes.remove_noop_casts import RemoveNoopCastsPass
from fx16.passes.remove_unused_casts import RemoveUnusedCastsPass
from fx16.program import Program

# Each round is one linear walk per rule; every rewrite removes a cast or moves a
# cast's input to an earlier node (or removes an op), so rounds are few. The cap only
# guards against a bug.
_MAX_ROUNDS = 64


# The cleanup rules in the order the driver tries them (the rules' reference page lists them).
STANDARD_RULES = (
    DeduplicateCastsPass,
    FuseCastChainsPass,
    BypassBranchingCastsPass,
    RemoveNoopCastsPass,
    RemoveIdentityArithmeticPass,
    RemoveUnusedCastsPass,
)


class CleanupCastsPass(PassBase):
    """Drive the cleanup rules to a fixed point.

    Default order: dedupe first (fewer nodes for the others), then fuse chains,
    bypass shared casts, drop the no-op casts, the identity arithmetic a runtime would
    pay for (``x * 1``, ``x + 0``) and the unused casts those rewrites leave.
    Runs on the program's graph and on the body of every higher-order op (each rule
    keeps the dtype of every value, so what a body returns keeps its dtype).
    Reads and writes what its rules do (casts, ``meta["fx16.kept_cast"]``, output specs).
    """

    def __init__(self, program: Program, rules: list[CastRule] | None = None) -> None:
        self.rules = rules or [rule(program) for rule in STANDARD_RULES]

    def call(self, graph_module: GraphModule) -> PassResult:
        modified = False
        for module in graph_module.modules():  # the program's graph, then every body
            if isinstance(module, GraphModule) and self._to_fixed_point(module):
                modified = True
                if module is not graph_module:
                    module.recompile()  # a body's code must match before its op runs
        Facts.invalidate(graph_module)  # nodes added, removed or rewired
        return PassResult(graph_module, modified)

    def _to_fixed_point(self, graph_module: GraphModule) -> bool:
        modified = False
        for _ in range(_MAX_ROUNDS):
            changed = [rule(graph_module).modified for rule in self.rules]
            if not any(changed):
                return modified
            modified = True
        raise PassFailedError(
            type(self).__name__, RuntimeError(f"no fixed point after {_MAX_ROUNDS} rounds")
        )
