"""WidenOtherSixteenBitPass: a program that holds the other 16-bit float dtype (a bf16
checkpoint cast to fp16, a ``.half()`` export cast to bf16) is widened to fp32 first,
so that the cast after it narrows it with the fp32 program's range rules."""

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.program import Program
from fx16.program.casts import retype_val
from fx16.program.nodes import dtype_arguments, node_dtype, set_argument
from fx16.program.subgraphs import nested_graph_modules

FP32 = torch.float32
OTHER_SIXTEEN_BIT = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}


def holds_dtype(program: Program, dtype: torch.dtype) -> bool:
    """Some parameter, buffer, tensor constant or user input of ``program`` is ``dtype``:
    the program was made in it (a checkpoint, an export of ``model.half()``), not an fp32
    program that casts one value to it on its own."""
    slots = [slot.placeholder for slot in program.state_slots()]
    return any(node_dtype(n) == dtype for n in [*slots, *program.user_input_placeholders()])


class WidenOtherSixteenBitPass(PassBase):
    """Widen every value of ``dtype`` to fp32, exactly (fp16 and bf16 are both subsets
    of fp32), in a program that holds ``dtype`` (``holds_dtype``); any other program is
    left as it is (``modified=False``), its own 16-bit casts included.

    Reads: the program's state tensors and signature, every node's ``meta["val"]``
    (nested bodies too). Writes: the state tensors of ``dtype`` as fp32 copies
    (through ``Program.replace_state_tensor``, inside the cast's transaction), the
    ``meta["val"]`` leaves of ``dtype`` as fp32, and each ``dtype`` argument (the
    model's ``x.to(torch.bfloat16)``, a creation op's ``dtype=``) as ``torch.float32``.
    The program computes what it did, in fp32; the callers' ``dtype`` inputs are
    converted by ``fx16.inputs_for`` as fp32 ones are.
    """

    def __init__(self, program: Program, dtype: torch.dtype) -> None:
        self.program, self.dtype = program, dtype

    def call(self, graph_module: GraphModule) -> PassResult:
        if not holds_dtype(self.program, self.dtype):
            return PassResult(graph_module, False)
        for slot in self.program.state_slots():
            tensor = self.program.state_tensor(slot.target)
            if isinstance(tensor, torch.Tensor) and tensor.dtype == self.dtype:
                self.program.replace_state_tensor(slot.target, tensor.detach().to(FP32))
        for module in nested_graph_modules(graph_module):
            for node in module.graph.nodes:
                self._widen(node)
            module.recompile()
        return PassResult(graph_module, True)

    def _widen(self, node: Node) -> None:
        for location, dtype in dtype_arguments(node):
            if dtype == self.dtype:
                set_argument(node, location, FP32)
        val = node.meta.get("val")
        if val is not None:
            node.meta["val"] = pytree.tree_map_only(
                torch.Tensor,
                lambda leaf: retype_val(leaf, FP32) if leaf.dtype == self.dtype else leaf,
                val,
            )
