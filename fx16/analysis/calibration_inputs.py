"""The calls a calibration runs: the caller's entries checked against the program's
inputs (their number, static shapes and kinds), or the program's example inputs."""

import torch
import torch.utils._pytree as pytree
from torch.fx import Node

from fx16.errors import InvalidOptionError
from fx16.nodes import dtype_name
from fx16.program import Program


def calibration_calls(
    program: Program, calibration: list | None, label: str = "calibration"
) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) calls to calibrate on: ``calibration``, or the example inputs.

    Each entry of ``calibration`` is an argument tuple, an (args, kwargs) pair, or a
    tensor for a program with one input; an entry that does not supply the
    program's user inputs, or gives one a shape the program does not take, raises
    ``InvalidOptionError`` naming it as ``label[index]``."""
    if calibration is None:
        example = program.ep.example_inputs
        return [example] if example is not None else []
    if not isinstance(calibration, (list, tuple)):
        raise InvalidOptionError(
            f"{label} must be a list of argument tuples, got {type(calibration).__name__}"
        )
    placeholders = program.user_input_placeholders()
    calls = []
    for index, entry in enumerate(calibration):
        if isinstance(entry, torch.Tensor):
            entry = (entry,)
        call = entry if _is_args_kwargs(entry) else (tuple(entry), {})
        supplied = pytree.tree_leaves(call)
        if len(supplied) != len(placeholders):
            raise InvalidOptionError(
                f"{label}[{index}] supplies {len(supplied)} input value(s); "
                f"the program takes {len(placeholders)}"
            )
        for value, placeholder in zip(supplied, placeholders):
            _check_shape(f"{label}[{index}]", value, placeholder)
        calls.append(call)
    return calls


def _check_shape(name: str, value, placeholder: Node) -> None:
    """A tensor whose static sizes differ from what the program takes is refused, and
    so is a float tensor where it takes integers (token ids), or the reverse."""
    val = placeholder.meta.get("val")
    if not (isinstance(value, torch.Tensor) and isinstance(val, torch.Tensor)):
        return
    if _dtype_kind(value.dtype) != _dtype_kind(val.dtype):
        raise InvalidOptionError(
            f"{name}: input {placeholder.name!r} is {_dtype_kind(value.dtype)} "
            f"({dtype_name(value.dtype)}); the program takes "
            f"{_dtype_kind(val.dtype)} ({dtype_name(val.dtype)})"
        )
    expected = ["*" if not isinstance(size, int) else size for size in val.shape]
    fits = len(expected) == value.dim() and all(
        want == "*" or want == got for want, got in zip(expected, value.shape)
    )
    if not fits:
        takes = "(" + ", ".join(map(str, expected)) + ")"
        raise InvalidOptionError(
            f"{name}: input {placeholder.name!r} has shape "
            f"{tuple(value.shape)}; the program takes {takes} (* = any size)"
        )


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "boolean"
    if dtype.is_complex:
        return "complex"
    return "floating point" if dtype.is_floating_point else "integer"


def _is_args_kwargs(entry) -> bool:
    return (
        isinstance(entry, tuple)
        and len(entry) == 2
        and isinstance(entry[0], tuple)
        and isinstance(entry[1], dict)
    )
