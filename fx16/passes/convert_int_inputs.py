"""ConvertIntInputsPass: castable int32/int64 user inputs become int16 inputs."""

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.casts import WHY_CAST_BACK, CastInserter, retype_val
from fx16.decisions import INT_PRECISION, decide
from fx16.narrowing import check_mode, int16_verdict, may_narrow
from fx16.nodes import node_dtype
from fx16.ops import WIDE_INT_DTYPES
from fx16.program import Program


class ConvertIntInputsPass(PassBase):
    """Declare a user input int16 when it is castable and its range fits.

    Callers pass int16 tensors for those inputs afterwards. The input is cast back
    to its original dtype for every consumer; consumers the int16 inserter narrows
    read the int16 input directly once cleanup folds that cast away.

    Reads: the int16 analyses' findings (see ``fx16.narrowing.int16_verdict``).
    Writes: the placeholders' ``meta["val"]``, a cast-back after each narrowed
    input, ``meta["fx16.int16"]`` on every wide integer input, the example inputs.
    """

    def __init__(self, program: Program, *, mode: str = "proven") -> None:
        self.program = program
        self.mode = check_mode(mode)

    def call(self, graph_module: GraphModule) -> PassResult:
        casts = CastInserter(graph_module.graph)
        new_dtypes = {}
        for index, placeholder in enumerate(self.program.user_input_placeholders()):
            original = node_dtype(placeholder)
            if original not in WIDE_INT_DTYPES or INT_PRECISION in placeholder.meta:
                continue
            reason, detail = int16_verdict(placeholder, self.mode)
            if not may_narrow(reason):
                decide(placeholder, original, reason, key=INT_PRECISION, detail=detail)
                continue
            placeholder.meta["val"] = retype_val(placeholder.meta["val"], torch.int16)
            decide(placeholder, torch.int16, reason, key=INT_PRECISION, detail=detail)
            casts.cast_after(placeholder, original, WHY_CAST_BACK)
            new_dtypes[index] = torch.int16
        self.program.retype_example_inputs(new_dtypes)
        return PassResult(graph_module, bool(new_dtypes))
