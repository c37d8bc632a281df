"""The calls a calibration runs: the caller's entries checked against the program's
inputs (their number, static shapes and kinds), or the program's example inputs."""

import math

import torch
import torch.utils._pytree as pytree
from torch.fx import Node

from fx16.analysis.intervals import size_range
from fx16.errors import InvalidOptionError
from fx16.program import Program
from fx16.program.nodes import dtype_name


def calibration_calls(
    program: Program, calibration: list | None, label: str = "calibration"
) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) calls to calibrate on: ``calibration``, or the example inputs.

    Each entry of ``calibration`` is an argument tuple, an (args, kwargs) pair, or a
    tensor for a program with one input; an entry that does not supply the
    program's user inputs, or gives one a shape the program does not take, raises
    ``InvalidOptionError`` naming it as ``label[index]``. A tensor of another float (or
    integer) dtype than its input's is converted to it, as ``fx16.inputs_for`` converts
    a call's (float64 calibration data for a float32 program)."""
    if calibration is None:
        example = program.ep.example_inputs
        return [example] if example is not None else []
    if not isinstance(calibration, (list, tuple)):
        raise InvalidOptionError(
            f"{label} must be a list of argument tuples, got {type(calibration).__name__}"
        )
    placeholders = program.user_input_placeholders()
    ranges = program.range_constraints()
    calls = []
    for index, entry in enumerate(calibration):
        if isinstance(entry, torch.Tensor):
            entry = (entry,)
        call = entry if _is_args_kwargs(entry) else (tuple(entry), {})
        supplied = pytree.tree_leaves(call)
        if len(supplied) != len(placeholders):  # said by input where the layout shows how
            problem = _structure_problem(call, program.ep.call_spec.in_spec, placeholders)
            raise InvalidOptionError(
                f"{label}[{index}] "
                + (
                    problem
                    or f"supplies {len(supplied)} input value(s); the program takes "
                    f"{len(placeholders)} ({', '.join(p.name for p in placeholders)})"
                )
            )
        for value, placeholder in zip(supplied, placeholders):
            _check_shape(f"{label}[{index}]", value, placeholder, ranges)
        calls.append(program.adapt_call(*call))  # float64 to the float32 it takes, ...
    return calls


def _structure_problem(call: tuple, in_spec, placeholders: list[Node]) -> str | None:
    """What is wrong with how ``call`` lays out the program's inputs, named by input:
    a keyword the program has no input of, a list or tuple where it takes one tensor,
    or too many positional arguments. None where nothing of that kind is wrong (the
    count of values is checked after)."""
    if in_spec is None or in_spec.num_children != 2:
        return None
    args_spec, kwargs_spec = in_spec.children()
    named, offset = {}, 0  # each positional input's name, and its spec
    for spec in args_spec.children():
        named[placeholders[offset].name if offset < len(placeholders) else ""] = spec
        offset += spec.num_leaves
    if kwargs_spec.type is dict:
        for key, spec in zip(kwargs_spec.context, kwargs_spec.children()):
            named[key] = spec
    args, kwargs = call
    names = ", ".join(filter(None, named))
    unknown = [key for key in kwargs if key not in named]
    if unknown:
        listed = ", ".join(map(repr, unknown))
        return f"passes unknown keyword(s) {listed}; the program's inputs: {names}"
    if len(args) > args_spec.num_children:
        return (
            f"passes {len(args)} positional arguments; the program takes "
            f"{args_spec.num_children} ({names})"
        )
    for name, value in [*zip(named, args), *kwargs.items()]:
        if named[name].is_leaf() and isinstance(value, (list, tuple)):
            return (
                f"passes a nested {type(value).__name__} for input {name!r}; the program "
                "takes a torch.Tensor there (convert it with torch.tensor)"
            )
    return None


def _check_shape(name: str, value, placeholder: Node, ranges: dict) -> None:
    """A tensor whose static sizes differ from what the program takes is refused, and
    so is one whose dynamic size lies outside the range the program was exported for
    (``ranges``: its range constraints), a float tensor where it takes integers (token
    ids) or the reverse, a float tensor with no finite value, and a value that is not
    a tensor (a NumPy array) where it takes one."""
    val = placeholder.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return
    if not isinstance(value, torch.Tensor):
        raise InvalidOptionError(
            f"{name}: input {placeholder.name!r} is a {type(value).__module__}."
            f"{type(value).__name__}; the program takes a torch.Tensor"
            + (" (convert it with torch.from_numpy)" if type(value).__module__ == "numpy" else "")
        )
    if _dtype_kind(value.dtype) != _dtype_kind(val.dtype):
        raise InvalidOptionError(
            f"{name}: input {placeholder.name!r} is {_dtype_kind(value.dtype)} "
            f"({dtype_name(value.dtype)}); the program takes "
            f"{_dtype_kind(val.dtype)} ({dtype_name(val.dtype)})"
        )
    expected = [size if isinstance(size, int) else _bounds(size, ranges) for size in val.shape]
    fits = len(expected) == value.dim() and all(
        want == got if isinstance(want, int) else want[0] <= got <= want[1]
        for want, got in zip(expected, value.shape)
    )
    if not fits:
        takes = "(" + ", ".join(map(_size_text, expected)) + ")"
        dynamic = not all(isinstance(size, int) for size in expected)
        raise InvalidOptionError(
            f"{name}: input {placeholder.name!r} has shape {tuple(value.shape)}; the program "
            f"takes {takes}" + (" (a..b: any size from a to b)" if dynamic else "")
        )
    if value.is_floating_point() and value.numel() and not bool(value.isfinite().any()):
        raise InvalidOptionError(
            f"{name}: input {placeholder.name!r} holds no finite value (all inf or NaN): "
            "it measures nothing"
        )


def _bounds(size, ranges: dict) -> tuple[float, float]:
    """The sizes a dynamic dimension may take (``size_range``: its range constraints)."""
    found = size_range(size, ranges)
    return (0, math.inf) if found is None else (found.low, found.high)


def _size_text(size) -> str:
    if isinstance(size, int):
        return str(size)
    low, high = size
    return f"{low}..{'' if math.isinf(high) else high}"


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
