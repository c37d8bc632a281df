"""ScalarsAsConstantsPass: a 16-bit op's Python-number operand becomes a 0-d constant of
the op's dtype, so that a runtime casts no constant on every call."""

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.choices import SCALARS_CHOICES as MODES
from fx16.errors import require_choice
from fx16.meta import scalar_rounds_exactly
from fx16.ops.tables import per_op
from fx16.program import Program
from fx16.program.nodes import SIXTEEN_BIT_DTYPES, is_number, node_val

SIXTEEN_BIT = (*SIXTEEN_BIT_DTYPES, torch.int16)
STEM = "fx16_scalar_"


def folded_value(scalar, dtype: torch.dtype, mode: str) -> torch.Tensor | None:
    """The 0-d ``dtype`` tensor that stands for ``scalar``, or None to keep the scalar.

    Eager computes a 16-bit float op's Python float in fp32 (the op's compute type),
    an integer op's int in the op's dtype. ``exact``: only a scalar that ``dtype``
    holds as eager computes it, so the op's result is eager's, bit for bit.
    ``rounded`` (floats): also one that ``dtype`` rounds to a normal number, a
    relative change below half a 16-bit ulp, which is what ExecuTorch's ``to_edge``
    computes anyway when it casts the scalar at run time; a scalar that would round
    to 0, a subnormal, an infinity or NaN is kept.
    """
    if mode == "keep" or isinstance(scalar, bool) or not isinstance(scalar, (int, float)):
        return None
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        fits = isinstance(scalar, int) and info.min <= scalar <= info.max
        return torch.tensor(scalar, dtype=dtype) if fits else None
    computed = torch.tensor(scalar, dtype=torch.float32)
    folded = computed.to(dtype)
    if folded.float().equal(computed):
        return folded
    rounds_to_normal = bool(folded.isfinite()) and abs(float(folded)) >= torch.finfo(dtype).tiny
    return folded if mode == "rounded" and rounds_to_normal else None


@per_op
def _tensor_arguments(target) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument of ``target``'s schema that takes a Tensor."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (index, argument.name)
        for index, argument in enumerate(schema.arguments)
        if isinstance(argument.type, torch.TensorType)
    )


def _scalar_operands(node: Node) -> list[tuple[int | str, object]]:
    """(position or keyword, value) of each Python number ``node`` passes where its
    schema takes a Tensor (what ``to_edge`` turns into an fp32 constant)."""
    found = []
    for index, name in _tensor_arguments(node.target):
        key = index if index < len(node.args) else name
        value = node.args[key] if isinstance(key, int) else node.kwargs.get(key)
        if is_number(value):
            found.append((key, value))
    return found


def _computes_in(node: Node, dtypes) -> torch.dtype | None:
    """The dtype of ``dtypes`` that ``node`` computes in: its result's, when every
    tensor operand but a mask has it too (a comparison's or a promoting op's compute
    type is not its result's, so neither is folded)."""
    result = node_val(node)
    if not isinstance(result, torch.Tensor) or result.dtype not in dtypes:
        return None
    for operand in node.all_input_nodes:
        value = node_val(operand)
        if isinstance(value, torch.Tensor) and value.dtype != torch.bool:
            if value.dtype != result.dtype:
                return None
    return result.dtype


class ScalarsAsConstantsPass(PassBase):
    """Replace each Python number that a 16-bit op takes in a Tensor argument by a 0-d
    constant of the op's dtype, one constant per value, dtype and device.

    Input graph:  h:f16 -> mul.Tensor(h, 0.125) -> y
    Output graph: c_fx16_scalar_0 (constant, f16, 0.125) ; h -> mul.Tensor(h, c) -> y

    ExecuTorch's ``to_edge`` turns such a scalar into an fp32 constant and inserts a
    cast to fp16 that runs on every call, outside the delegate. A constant already in
    the op's dtype needs no cast. Which scalars (``mode``): ``"exact"`` (the default:
    those the 16-bit type holds, so every result is eager's bit for bit, and those of
    an op whose result is eager's with the scalar rounded: ``meta["fx16.scalar_rounds_exactly"]``,
    set by the stable RMSNorm's ``sqrt(eps)`` term),
    ``"rounded"`` (also the floats it rounds to a normal number, as ``to_edge``'s cast
    does), ``"keep"`` (none). ``dtypes``: the op dtypes it looks at (the fp16
    pipeline's are fp16 and bf16, the int16 pipeline's int16). Only the program's
    own graph: a scalar inside a
    higher-order op's body would need the constant threaded in as an operand, and
    stays.

    Reads: ``meta["val"]`` of each op and its operands, op schemas,
    ``meta["fx16.scalar_rounds_exactly"]``. Writes: new
    constants (``ep.constants``, the graph signature, placeholders after the state).
    Costs: nothing at run time; one 2-byte constant per distinct value.
    The graph's code is left to whoever runs the pipeline to recompile, once at the end
    (``fx16.pipelines.run_passes``; torch's ``PassManager`` recompiles after each pass).
    """

    def __init__(self, program: Program, mode: str = "exact", dtypes=SIXTEEN_BIT) -> None:
        super().__init__()
        require_choice("scalars", mode, MODES)
        self.program, self.mode, self.dtypes = program, mode, tuple(dtypes)

    def call(self, graph_module: GraphModule) -> PassResult:
        constants: dict[tuple, Node] = {}
        folded: dict[tuple, torch.Tensor | None] = {}
        modified = False
        for node in list(graph_module.graph.nodes):
            if node.op != "call_function":
                continue
            operands = _scalar_operands(node)
            dtype = _computes_in(node, self.dtypes) if operands else None
            if dtype is None:
                continue
            device = node_val(node).device
            mode = "rounded" if self.mode == "exact" and scalar_rounds_exactly(node) else self.mode
            for key, scalar in operands:
                # 1 and 1.0, 0.0 and -0.0 compare equal: the key keeps them apart
                asked = (dtype, mode, scalar if isinstance(scalar, int) else scalar.hex())
                if asked not in folded:
                    folded[asked] = folded_value(scalar, dtype, mode)
                value = folded[asked]
                if value is None:
                    continue
                identity = (value.view(torch.int16).item(), value.dtype, str(device))  # -0.0 apart
                if identity not in constants:
                    constants[identity] = self.program.add_constant(STEM, value.to(device))
                if isinstance(key, int):
                    node.update_arg(key, constants[identity])
                else:
                    node.update_kwarg(key, constants[identity])
                modified = True
        return PassResult(graph_module, modified)
