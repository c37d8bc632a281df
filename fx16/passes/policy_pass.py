"""PolicyPass: what the fp16 stages share: the program, the policy and the fp32 overrides."""

from torch.fx.passes.infra.pass_base import PassBase

from fx16.numerics import largest
from fx16.policy import PrecisionPolicy
from fx16.program import Program


class PolicyPass(PassBase):
    """Base of the passes that follow a PrecisionPolicy.

    program: the ExportedProgram view. policy: default ``PrecisionPolicy.default()``.
    overflow_margin: a calibrated value overflows above the 16-bit maximum / margin.
    force_fp32: node names that must stay fp32 (the accuracy-budget search sets them).
    """

    def __init__(
        self,
        program: Program,
        *,
        policy: PrecisionPolicy | None = None,
        overflow_margin: float = 2.0,
        force_fp32: frozenset[str] = frozenset(),
    ) -> None:
        self.program = program
        self.policy = policy or PrecisionPolicy.default()
        self.overflow_margin = overflow_margin
        self.force_fp32 = frozenset(force_fp32)

    @property
    def limit(self) -> float:
        """Largest calibrated magnitude still taken to fit the policy's 16-bit dtype."""
        return largest(self.policy.low) / self.overflow_margin
