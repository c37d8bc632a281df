"""Int16Pass: what the two int16 transforms share: the program and the narrowing mode."""

from torch.fx.passes.infra.pass_base import PassBase

from fx16.plan.narrowing import check_mode
from fx16.program import Program


class Int16Pass(PassBase):
    """Base of the int16 transforms. mode: "proven", "observed" or "assume_safe"
    (see ``fx16.plan.narrowing``); "off" is handled by the pipeline, which then has no passes."""

    def __init__(self, program: Program, *, mode: str = "proven") -> None:
        self.program = Program.of(program)
        self.mode = check_mode(mode)
