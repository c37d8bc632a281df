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

    An input whose calibration values exceed ``65504 / overflow_margin`` stays fp32.

    Reads: the user-input placeholders and their ``meta["fx16.observed_range"]``.
    Writes: their ``meta["val"]`` and ``meta["fx16.precision"]``; the program's
    recorded example inputs, converted to match.
    """

    def __init__(self, program: Program, *, overflow_margin: float = 2.0) -> None:
        self.program = program
        self.limit = FP16_MAX / overflow_margin

    def call(self, graph_module: GraphModule) -> PassResult:
        new_dtypes = {}
        for index, placeholder in enumerate(self.program.user_input_placeholders()):
            if node_dtype(placeholder) != torch.float32:
                continue
            if placeholder.meta.get(CalibrationAnalysis.META_KEY, 0.0) > self.limit:
                decide(placeholder, torch.float32, Reason.ACTIVATION_OVERFLOW)
                continue
            placeholder.meta["val"] = retype_val(placeholder.meta["val"], torch.float16)
            decide(placeholder, torch.float16, Reason.FITS)
            new_dtypes[index] = torch.float16
        self.program.retype_example_inputs(new_dtypes)
        return PassResult(graph_module, bool(new_dtypes))
