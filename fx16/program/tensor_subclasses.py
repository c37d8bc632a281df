"""State tensors that are tensor subclasses, and their 16-bit versions.

torchao keeps quantized weights as traceable wrapper subclasses (``Int8Tensor``: int8
``qdata``, fp32 ``scale``, and an fp32 "dequantized" dtype in its flatten context), and
``torch.export`` leaves them in the program's state. Such a tensor is seen through
``__tensor_flatten__`` / ``__tensor_unflatten__``: its fp32 inner tensors become 16-bit,
fp32 in its context becomes the 16-bit dtype (the dtype it dequantizes to), every other
inner tensor - the quantized data - is passed on as the same object. A subclass that
cannot be rebuilt that way, or whose dtype does not follow, is left as it is.

For plain tensors every function here does what its ``fx16.ops.numerics`` counterpart does.
"""

from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fx16.ops.numerics import tensor_overflows_fp16, tensor_to_fp16
from fx16.program.casts import retype_val

FP32 = torch.float32


def is_subclass(tensor: torch.Tensor) -> bool:
    """A wrapper subclass whose inner tensors hold the data (torchao's quantized tensors)."""
    return type(tensor) not in _PLAIN and is_traceable_wrapper_subclass(tensor)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # never wrapper subclasses: no need to ask


def inner_tensors(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The plain tensors holding a tensor's data, by attribute path ('' for a plain
    tensor, '.qdata' and '.scale' for an Int8Tensor; nested subclasses are followed)."""
    if not is_subclass(tensor):
        return {"": tensor}
    names, _ = tensor.__tensor_flatten__()
    found = {}
    for name in names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            for path, leaf in inner_tensors(inner).items():
                found[f".{name}{path}"] = leaf
    return found


def state_overflows(tensor: torch.Tensor, low: torch.dtype) -> bool:
    """A finite fp32 element of the tensor (or of a subclass's inner tensors) exceeds ``low``."""
    return any(
        inner.dtype == FP32 and tensor_overflows_fp16(inner, low)
        for inner in inner_tensors(tensor).values()
    )


def narrowed_state(tensor: torch.Tensor, low: torch.dtype) -> torch.Tensor | None:
    """The fp32 state tensor in ``low`` (tiny magnitudes lifted, not flushed), or None
    for a subclass that cannot hold ``low`` values. The input is not modified."""
    if not is_subclass(tensor):
        return tensor_to_fp16(tensor, low)
    return _rebuilt(tensor, low, lambda inner: tensor_to_fp16(inner, low))


def narrowed_val(val: torch.Tensor, low: torch.dtype) -> torch.Tensor | None:
    """The fake value of a narrowed state tensor (what ``narrowed_state`` gives, in fake)."""
    if not is_subclass(val):
        return retype_val(val, low)
    return _rebuilt(val, low, lambda inner: retype_val(inner, low))


def _rebuilt(
    tensor: torch.Tensor, low: torch.dtype, convert: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    names, context = tensor.__tensor_flatten__()
    inner = {}
    for name in names:
        value = getattr(tensor, name)
        if is_subclass(value):
            return None  # nested subclasses: left as they are
        inner[name] = convert(value) if value.dtype == FP32 else value
    context = pytree.tree_map(lambda item: low if item is FP32 else item, context)
    try:
        rebuilt = type(tensor).__tensor_unflatten__(inner, context, tensor.shape, tensor.stride())
    except Exception:  # the subclass does not take 16-bit parts: keep it as it is
        return None
    return rebuilt if rebuilt.dtype == low else None
