"""ConvertUserInputsPass: fp32 user inputs become fp16 inputs."""

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.analysis.calibration import CalibrationAnalysis
from fx16.casts import retype_val
from fx16.decisions import Reason, decide
from fx16.nodes import node_dtype
from fx16.numerics import FP16_MAX
from fx16.program import Program


class ConvertUserInputsPass(PassBase):
    """Declare every fp32 user input as fp16: callers pass fp16 tensors afterwards.

    An input whose calibration values exceed ``65504 / overflow_margin``, or that is
    named in ``force_fp32``, stays fp32.

    Reads: the user-input placeholders and their ``meta["fx16.observed_range"]``.
    Writes: their ``meta["val"]`` and ``meta["fx16.precision"]``; the program's
    recorded example inputs, converted to match.
    """

    def __init__(
        self,
        program: Program,
        *,
        overflow_margin: float = 2.0,
        force_fp32: frozenset[str] = frozenset(),
    ) -> None:
        self.program = program
        self.limit = FP16_MAX / overflow_margin
        self.force_fp32 = frozenset(force_fp32)

    def call(self, graph_module: GraphModule) -> PassResult:
        converted = False
        for placeholder in self.program.user_input_placeholders():
            if node_dtype(placeholder) != torch.float32:
                continue
            if placeholder.name in self.force_fp32:
                decide(placeholder, torch.float32, Reason.ACCURACY_FALLBACK)
                continue
            if placeholder.meta.get(CalibrationAnalysis.META_KEY, 0.0) > self.limit:
                decide(placeholder, torch.float32, Reason.ACTIVATION_OVERFLOW)
                continue
            placeholder.meta["val"] = retype_val(placeholder.meta["val"], torch.float16)
            decide(placeholder, torch.float16, Reason.FITS)
            converted = True
        if converted:
            self.program.adapt_example_inputs()
        return PassResult(graph_module, converted)
