"""WidenOtherSixteenBitPass: the part of a program made in the other 16-bit float dtype
(a bf16 checkpoint cast to fp16, a ``.half()`` export cast to bf16) is widened to fp32
first, so that the cast after it narrows it with the fp32 program's range rules."""

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.analysis.facts import Facts
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from fx16.program.casts import retype_val
from fx16.program.cost import tensor_bytes
from fx16.program.lazy_code import compile_when_needed
from fx16.program.nodes import dtype_arguments, node_val, set_argument, tensor_leaves
from fx16.program.subgraphs import AUTOCAST, bodies_and_operands, nested_graph_modules

FP32 = torch.float32
OTHER_SIXTEEN_BIT = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}


def _holds(node: Node, dtype: torch.dtype) -> bool:
    return any(leaf.dtype == dtype for leaf in tensor_leaves(node_val(node)))


def made_in(program: Program, dtype: torch.dtype, boundaries: Boundaries) -> set[Node]:
    """The values a program made in ``dtype`` computes in it: None unless most of its
    float parameters, buffers, constants and user inputs (by bytes) are ``dtype`` (a
    checkpoint shipped in bf16; an fp32 program that keeps one bf16 buffer, or rounds
    to bf16 on its own, is not made in it). Then each such input of ``dtype`` with the
    ``dtype`` values joined to it by the ops between them, across bodies (a bf16
    weight, the linear reading it, the model's cast back to bf16 after an fp32
    variance), except a set with a value inside a ``torch.autocast`` body, whose dtypes
    the region sets."""
    graph_inputs = [slot.placeholder for slot in program.state_slots()]
    graph_inputs += program.user_input_placeholders()
    seeds = [node for node in graph_inputs if _holds(node, dtype)]
    if 2 * _float_bytes(seeds) <= _float_bytes(graph_inputs):
        return set()
    autocast = _autocast_body_nodes(boundaries)
    found: set[Node] = set()
    for seed in seeds:
        if seed in found:
            continue
        component, pending = {seed}, [seed]
        while pending:
            node = pending.pop()
            for other in [*boundaries.inputs(node), *boundaries.readers(node)]:
                if other not in component and _holds(other, dtype):
                    component.add(other)
                    pending.append(other)
        if not component & autocast:
            found |= component
    return found


def _float_bytes(nodes: list[Node]) -> int:
    floats = [
        leaf for n in nodes for leaf in tensor_leaves(node_val(n)) if leaf.is_floating_point()
    ]
    return tensor_bytes(floats)


def _autocast_body_nodes(boundaries: Boundaries) -> set[Node]:
    """The nodes of every ``wrap_with_autocast`` body, and of the bodies nested in it."""
    inside: set[Node] = set()
    for module in boundaries.graph_modules:
        for node in module.graph.find_nodes(op="call_function", target=AUTOCAST):
            for body in bodies_and_operands(node)[0]:
                for nested in nested_graph_modules(getattr(module, body.target)):
                    inside.update(nested.graph.nodes)
    return inside


class WidenOtherSixteenBitPass(PassBase):
    """Widen the values a program computes in ``dtype`` because it was made in it
    (``made_in``: its bf16 weights, what they compute, the model's casts back to bf16
    between them) to fp32, exactly (fp16 and bf16 are both subsets of fp32). An fp32
    program's own rounding to ``dtype``, and a buffer of ``dtype`` that only promotes
    into fp32, are the model's and stay.

    Reads: the program's state tensors and signature, every node's ``meta["val"]``
    (nested bodies too). Writes: those state tensors as fp32 (``Program.store_state``:
    inside the cast's transaction, converted only at its commit, where the cast did not
    narrow them again, so a bf16 checkpoint is stored fp16 tensor by tensor with no fp32
    copy; until then runs widen each as they read it), those nodes'
    ``meta["val"]`` leaves of ``dtype`` as fp32, and their ``dtype`` arguments (the
    model's ``x.to(torch.bfloat16)``, a creation op's ``dtype=``, the metadata asserts
    that check them) as ``torch.float32``, and the recorded example inputs as the
    widened inputs take them. The program computes what it did, in fp32; callers'
    ``dtype`` inputs are converted by ``fx16.inputs_for`` as fp32 ones are.
    """

    def __init__(self, program: Program, dtype: torch.dtype) -> None:
        self.program, self.dtype = program, dtype

    def call(self, graph_module: GraphModule) -> PassResult:
        boundaries = Facts.of(graph_module).boundaries  # shared with the analyses after it
        widened = made_in(self.program, self.dtype, boundaries)
        if not widened:
            return PassResult(graph_module, False)
        for slot in self.program.state_slots():
            if slot.placeholder in widened:
                self.program.store_state(slot.target, FP32, may_flush=False)
        if not self.program.defers_state:
            self.program.commit_state()
        for module in boundaries.graph_modules:
            for node in module.graph.nodes:
                if node in widened or any(arg in widened for arg in node.all_input_nodes):
                    self._widen(node)
            compile_when_needed(module)  # its code generated when first needed
        if any(node in widened for node in self.program.user_input_placeholders()):
            self.program.adapt_example_inputs()  # the recorded inputs, as the program takes them
        Facts.invalidate(graph_module)  # dtype arguments changed: the regions they open too
        return PassResult(graph_module, True)

    def _widen(self, node: Node) -> None:
        """``node``'s ``dtype`` arguments and value as fp32; for a reader of a widened
        value that computes in another dtype (``.float()``), only its arguments."""
        for location, dtype in dtype_arguments(node):
            if dtype == self.dtype:
                set_argument(node, location, FP32)
        val = node.meta.get("val")
        if val is not None:
            node.meta["val"] = pytree.tree_map_only(torch.Tensor, self._widened, val)

    def _widened(self, leaf: torch.Tensor) -> torch.Tensor:
        return retype_val(leaf, FP32) if leaf.dtype == self.dtype else leaf
