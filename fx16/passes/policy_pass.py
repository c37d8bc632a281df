"""PolicyPass: what the fp16 stages share: the program, the policy and the fp32 overrides."""

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase

from fx16.analysis.fp32_rules import fp32_rule
from fx16.decisions import Decision, Reason
from fx16.ops.numerics import largest
from fx16.policy import PrecisionPolicy
from fx16.program import Program


class PolicyPass(PassBase):
    """Base of the passes that follow a PrecisionPolicy.

    program: the ExportedProgram view. policy: default ``PrecisionPolicy.default()``.
    overflow_margin: a calibrated value overflows above the 16-bit maximum / margin.
    force_fp32: node names that must stay fp32 (the caller's ``force_fp32`` and the
        accuracy-budget search's choices; Fp32RulesAnalysis tells the two apart).
    """

    def __init__(
        self,
        program: Program,
        *,
        policy: PrecisionPolicy | None = None,
        overflow_margin: float = 2.0,
        force_fp32: frozenset[str] = frozenset(),
    ) -> None:
        self.program = Program.of(program)
        self.policy = policy or PrecisionPolicy.default()
        self.overflow_margin = overflow_margin
        self.force_fp32 = frozenset(force_fp32)

    @property
    def limit(self) -> float:
        """Largest calibrated magnitude still taken to fit the policy's 16-bit dtype."""
        return overflow_limit(self.policy, self.overflow_margin)

    def kept_fp32(self, node: Node) -> Decision | None:
        """The safety rule keeping ``node`` in fp32 (``meta["fx16.fp32_rule"]``), or,
        where no Fp32RulesAnalysis ran, a name in ``force_fp32``."""
        rule = fp32_rule(node)
        if rule is None and node.name in self.force_fp32:
            return Decision(torch.float32, Reason.FORCED, f"force_fp32={node.name!r}")
        return rule


def overflow_limit(policy: PrecisionPolicy, overflow_margin: float) -> float:
    """Largest calibrated magnitude still taken to fit the policy's 16-bit dtype."""
    return largest(policy.low) / overflow_margin
