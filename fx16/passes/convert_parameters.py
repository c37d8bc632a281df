"""ConvertParametersPass: fp32 parameters, buffers and tensor constants to fp16."""

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.casts import retype_val
from fx16.decisions import Reason, decide
from fx16.numerics import tensor_overflows_fp16, tensor_to_fp16
from fx16.program import Program


class ConvertParametersPass(PassBase):
    """Store every fp32 state tensor that fits fp16 as fp16.

    Reads: the program's parameters, buffers and tensor constants (lifted ones too).
    Writes: the converted tensors back into the program; their placeholders'
    ``meta["val"]``; ``meta["fx16.precision"]`` on every fp32 state placeholder.

    A tensor with a finite magnitude above 65504 stays fp32. Nonzero magnitudes
    below the smallest fp16 subnormal become +-2**-24 instead of zero. Tensors of
    other dtypes (int8 quantized weights, fp64, bf16, fp16) are left alone. A tensor
    stored under several names is converted once and shared again. Placeholders named
    in ``force_fp32`` stay fp32 (the accuracy-budget search uses it).
    """

    def __init__(self, program: Program, *, force_fp32: frozenset[str] = frozenset()) -> None:
        self.program = program
        self.force_fp32 = frozenset(force_fp32)

    def call(self, graph_module: GraphModule) -> PassResult:
        converted: dict[int, torch.Tensor] = {}
        modified = False
        for slot in self.program.state_slots():
            tensor = self.program.state_tensor(slot.target)
            if tensor is None or tensor.dtype != torch.float32:
                continue
            if slot.placeholder.name in self.force_fp32:
                decide(slot.placeholder, torch.float32, Reason.ACCURACY_FALLBACK)
                continue
            if tensor_overflows_fp16(tensor):
                decide(slot.placeholder, torch.float32, Reason.VALUE_OVERFLOW)
                continue
            if id(tensor) not in converted:
                converted[id(tensor)] = tensor_to_fp16(tensor)
            self.program.replace_state_tensor(slot.target, converted[id(tensor)])
            placeholder = slot.placeholder
            placeholder.meta["val"] = retype_val(placeholder.meta["val"], torch.float16)
            decide(placeholder, torch.float16, Reason.FITS)
            modified = True
        return PassResult(graph_module, modified)
