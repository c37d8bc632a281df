"""Small read-only questions about FX nodes: dtypes, inputs, scalar arguments.

Scalars are found through the op schema: a number in an argument declared
``Scalar``, ``float`` or ``Tensor`` enters the computation (an fp16 op needs it in
range); ``int`` arguments are sizes, dims or indices and are never touched.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from fx16.ops.declarations import declaration
from fx16.ops.tables import is_custom_op, per_op

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
SIXTEEN_BIT_DTYPES = frozenset({torch.float16, torch.bfloat16})

# Tensor-typed arguments count too: torch.export passes ``x * 2.0`` as mul.Tensor(x, 2.0).
_SCALAR_TYPES = frozenset(
    {"number", "Optional[number]", "float", "Optional[float]", "Tensor", "Optional[Tensor]"}
)

# Where an argument sits in a node: ("args", index) or ("kwargs", name).
Location = tuple[str, Any]


def node_val(node: Any) -> Any:
    """The fake value torch.export recorded for a node (None for non-nodes or when absent)."""
    return node.meta.get("val") if isinstance(node, Node) else None


def node_dtype(node: Any) -> torch.dtype | None:
    """dtype of a node's tensor value, or None when the node is not a single tensor."""
    val = node_val(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` as "float16"."""
    return str(dtype).removeprefix("torch.")


def op_label(node: Node) -> str:
    """How the report names a node's op: "linear.default", "getitem" (a Python
    function by its name), or "placeholder" (a graph input)."""
    if node.op != "call_function":
        return node.op
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target).removeprefix("aten.")
    return getattr(node.target, "__name__", str(node.target))


def node_module_path(node: Node) -> str | None:
    """The innermost module path of a node ("layers.0.mlp.fc"), from nn_module_stack."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path.removeprefix("L['self'].").removeprefix("L__self__.")


def tensor_inputs(node: Node) -> list[Node]:
    """The distinct input nodes whose value is a tensor, in argument order."""
    return [arg for arg in node.all_input_nodes if isinstance(node_val(arg), torch.Tensor)]


@dataclass(frozen=True)
class SchemaArgument:
    """What fx16 reads of one argument of an op schema (read once per op, then cached:
    ``FunctionSchema.arguments`` builds fresh objects on every access)."""

    name: str
    type: str
    kwarg_only: bool
    writes: bool  # an in-place op's output aliases this argument
    has_default: bool
    default: Any
    is_dtype: bool  # declared ScalarType (the schema's ``type`` then reads "int")


@per_op
def op_arguments(target: Any) -> tuple[SchemaArgument, ...] | None:
    """The schema arguments of an op, or None for a target without a schema."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    return tuple(
        SchemaArgument(
            name=argument.name,
            type=str(argument.type),
            kwarg_only=argument.kwarg_only,
            writes=argument.alias_info is not None and argument.alias_info.is_write,
            has_default=argument.has_default_value(),
            default=argument.default_value if argument.has_default_value() else None,
            is_dtype=str(argument.real_type).removeprefix("Optional[").startswith("ScalarType"),
        )
        for argument in schema.arguments
    )


@per_op
def _arguments_by_name(target: Any) -> dict[str, SchemaArgument]:
    return {argument.name: argument for argument in op_arguments(target) or ()}


def schema_arguments(node: Node) -> Iterator[tuple[Location, SchemaArgument, Any]]:
    """(location, schema argument, value) for every argument the node passes explicitly."""
    arguments = op_arguments(node.target)
    if arguments is None:
        return
    for index, value in enumerate(node.args[: len(arguments)]):
        yield ("args", index), arguments[index], value
    if node.kwargs:
        by_name = _arguments_by_name(node.target)
        for name, value in node.kwargs.items():
            if name in by_name:
                yield ("kwargs", name), by_name[name], value


def value_scalars(node: Node) -> list[tuple[Location, int | float]]:
    """Numbers passed in ``Scalar``, ``float`` or ``Tensor`` arguments (bools excluded)."""
    slots = _scalar_slots(node.target)
    if not slots:
        return []
    positions, names = slots
    found = []
    args = node.args
    for index in positions:
        if index < len(args) and is_number(args[index]):
            found.append((("args", index), args[index]))
    for name, value in node.kwargs.items():
        if name in names and is_number(value):
            found.append((("kwargs", name), value))
    return found


def is_number(value: Any) -> bool:
    """A Python int or float (not a bool): a number an op argument may carry."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_float_tensor(value: Any) -> bool:
    """A tensor of a floating dtype (a node's fake value, an output, an argument)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point()


@per_op
def _scalar_slots(target: Any) -> tuple[tuple[int, ...], frozenset[str]] | None:
    """The positions and names of an op's arguments that may carry a number (declared
    ``Scalar``, ``float`` or ``Tensor``), from its schema."""
    arguments = op_arguments(target) or ()
    scalar = [(i, a) for i, a in enumerate(arguments) if a.type in _SCALAR_TYPES]
    if not scalar:
        return None
    positions = tuple(i for i, a in scalar if not a.kwarg_only)
    return positions, frozenset(a.name for _, a in scalar)


# How a schema stores a ScalarType default of float32 (c10::ScalarType::Float).
_FLOAT32_CODE = 6


def dtype_arguments(node: Node) -> list[tuple[Location, torch.dtype]]:
    """Arguments that pass a dtype (``dtype=torch.float32`` and the like).

    For a custom op, a dtype argument left to a float32 default counts too, as the
    keyword that would pass it (torchao's ``dequantize_affine(..., output_dtype=float32)``):
    its dtype arguments name its output type, which follows the cast; so does the one
    its declaration names (``fx16.ops.declarations``: PT2E's ``dequantize_per_tensor``
    returns fp32 for an ``out_dtype`` of None)."""
    kind = _dtype_kind(node.target)
    if kind is None or (kind == "aten" and not _passes_any(node, torch.dtype)):
        return []
    custom = kind == "custom"
    found = [
        (location, value)
        for location, _, value in schema_arguments(node)
        if isinstance(value, torch.dtype)
    ]
    if custom:
        passed = {
            argument.name for _, argument, value in schema_arguments(node) if value is not None
        }
        found += [
            (("kwargs", argument.name), torch.float32)
            for argument in op_arguments(node.target) or ()
            if argument.is_dtype
            and argument.has_default
            and argument.default in (_FLOAT32_CODE, torch.float32)
            and argument.name not in passed
        ]
        declared = declaration(node.target)  # an output dtype None or absent stands for one
        if declared is not None and declared.output_dtype and declared.output_dtype not in passed:
            location = ("kwargs", declared.output_dtype)
            if all(at != location for at, _ in found):
                found.append((location, declared.output_dtype_default))
    return found


@per_op
def _dtype_kind(target: Any) -> str | None:
    """How an op may pass a dtype: "custom" (any custom op), "aten" (its schema declares
    a ScalarType argument, the only kind an ATen op passes a dtype in; or it has no
    schema, so its arguments are unknown), None (it passes none)."""
    if is_custom_op(target):
        return "custom"
    arguments = op_arguments(target)
    return "aten" if arguments is None or any(argument.is_dtype for argument in arguments) else None


def _passes_any(node: Node, types) -> bool:
    """``node`` passes a value of ``types`` directly (not in a list) in its arguments."""
    for value in node.args:
        if isinstance(value, types):
            return True
    for value in node.kwargs.values():
        if isinstance(value, types):
            return True
    return False


def requested_dtypes(node: Node) -> list[torch.dtype]:
    """The dtypes an op is explicitly asked to compute in (``sum(dtype=torch.float32)``).

    A custom op's dtype argument is not such a request: it names the type of its output
    (``coreai.dequantize(..., output_dtype=torch.float32)``), which follows the
    precision the op runs in, as coreai-opt treats it.
    """
    if _dtype_kind(node.target) != "aten":
        return []
    return [dtype for _, dtype in dtype_arguments(node)]


def named_argument(node: Node, name: str) -> Any:
    """The value of the schema argument ``name``: passed explicitly, or its default."""
    for _, argument, value in schema_arguments(node):
        if argument.name == name:
            return value
    for argument in op_arguments(node.target) or ():
        if argument.name == name and argument.has_default:
            return argument.default
    return None


def accepts_keyword(node: Node, name: str) -> bool:
    """The op takes a keyword-only argument ``name`` that the node does not pass yet."""
    return name not in node.kwargs and any(
        argument.name == name and argument.kwarg_only
        for argument in op_arguments(node.target) or ()
    )


def set_argument(node: Node, location: Location, value: Any) -> None:
    kind, key = location
    if kind == "args":
        args = list(node.args)
        args[key] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, key: value}


def mutated_argument(node: Node) -> Node | None:
    """The input an in-place op writes to (``add_``'s self, ``copy_``'s dst), if any."""
    written = _written_argument(node.target)
    if written is None:
        return None
    index, name = written
    value = node.args[index] if index < len(node.args) else node.kwargs.get(name)
    return value if isinstance(value, Node) else None


@per_op
def _written_argument(target: Any) -> tuple[int, str] | None:
    """(position, name) of the argument an op writes in place; None if none."""
    arguments = op_arguments(target) or ()
    return next(((i, a.name) for i, a in enumerate(arguments) if a.writes), None)


def float_rank(dtype: torch.dtype) -> int:
    """Float dtypes ordered by width: 16-bit < fp32 < fp64."""
    return {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}[dtype]


def tensor_leaves(value) -> list[torch.Tensor]:
    """The tensors in a value, a list or tuple of them, or nested ones."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in tensor_leaves(item)]
    return []


def has_fp32_part(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float32
    return any(leaf.dtype == torch.float32 for leaf in tensor_leaves(value))
