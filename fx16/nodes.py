"""Small read-only questions about FX nodes: dtypes, inputs, scalar arguments.

Scalars are found through the op schema: a number in an argument declared
``Scalar``, ``float`` or ``Tensor`` enters the computation (an fp16 op needs it in
range); ``int`` arguments are sizes, dims or indices and are never touched.
"""

from collections.abc import Iterator
from typing import Any

import torch
from torch.fx import Node

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

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


def tensor_inputs(node: Node) -> list[Node]:
    """The distinct input nodes whose value is a tensor, in argument order."""
    return [arg for arg in node.all_input_nodes if isinstance(node_val(arg), torch.Tensor)]


def schema_arguments(node: Node) -> Iterator[tuple[Location, Any, Any]]:
    """(location, schema argument, value) for every argument the node passes explicitly."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return
    by_name = {arg.name: arg for arg in schema.arguments}
    for index, value in enumerate(node.args):
        if index < len(schema.arguments):
            yield ("args", index), schema.arguments[index], value
    for name, value in node.kwargs.items():
        if name in by_name:
            yield ("kwargs", name), by_name[name], value


def value_scalars(node: Node) -> list[tuple[Location, int | float]]:
    """Numbers passed in ``Scalar``, ``float`` or ``Tensor`` arguments (bools excluded)."""
    found = []
    for location, argument, value in schema_arguments(node):
        if str(argument.type) in _SCALAR_TYPES and isinstance(value, (int, float)):
            if not isinstance(value, bool):
                found.append((location, value))
    return found


def dtype_arguments(node: Node) -> list[tuple[Location, torch.dtype]]:
    """Arguments that pass a dtype (``dtype=torch.float32`` and the like)."""
    return [
        (location, value)
        for location, _, value in schema_arguments(node)
        if isinstance(value, torch.dtype)
    ]


def named_argument(node: Node, name: str) -> Any:
    """The value of the schema argument ``name``: passed explicitly, or its default."""
    for _, argument, value in schema_arguments(node):
        if argument.name == name:
            return value
    schema = getattr(node.target, "_schema", None)
    for argument in schema.arguments if schema is not None else ():
        if argument.name == name and argument.has_default_value():
            return argument.default_value
    return None


def accepts_keyword(node: Node, name: str) -> bool:
    """The op takes a keyword-only argument ``name`` that the node does not pass yet."""
    schema = getattr(node.target, "_schema", None)
    return (
        schema is not None
        and name not in node.kwargs
        and any(arg.name == name and arg.kwarg_only for arg in schema.arguments)
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
    for _, argument, value in schema_arguments(node):
        if argument.alias_info is not None and argument.alias_info.is_write:
            return value if isinstance(value, Node) else None
    return None
