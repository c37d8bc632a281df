"""Reading a tensor stored narrower than the graph reads it (a bf16 checkpoint's weight,
pending its widening to fp32) without ever making its whole fp32 copy.

A run during a cast (calibration, the emulation) hands such a tensor as stored
(``Program.graph_inputs(widen=False)``); ``fx16.program.interpreter.LeanInterpreter``
gives the op that reads it a ``NarrowRead``. A product reading one as its weight
(``linear``, ``mm``, ``matmul``) widens it a block of rows or columns at a time into one
reused buffer that stays in cache and computes its result block by block; an embedding
gathers its rows first and widens those. Any other op reads it widened whole. Either way
the op computes what it computes on the widened tensor, and a run's cost is one read of
the stored weights: no fp32 copy of a weight, no fresh pages for one.
"""

from collections.abc import Callable

import torch

aten = torch.ops.aten

# the elements of one block of a weight, widened: 4 MiB in fp32
BLOCK = 1 << 20

Transform = Callable[[torch.Tensor], torch.Tensor]


class NarrowRead:
    """A stored tensor read as ``dtype``, then through ``transforms`` (an emulation's
    rounding of what a 16-bit op reads), deferred to the op that reads it."""

    def __init__(self, stored: torch.Tensor, dtype: torch.dtype, transforms=()) -> None:
        self.stored, self.dtype, self.transforms = stored, dtype, tuple(transforms)

    def then(self, transform: Transform) -> "NarrowRead":
        return NarrowRead(self.stored, self.dtype, (*self.transforms, transform))

    def whole(self) -> torch.Tensor:
        return self.read(self.stored)

    def read(self, part: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """``part`` (of the stored tensor) as the op reads it: widened (into ``into``,
        a buffer of its shape, where given), then transformed."""
        widened = into.copy_(part) if into is not None else part.to(self.dtype)
        for transform in self.transforms:
            widened = transform(widened)
        return widened


def as_read(value, dtype: torch.dtype | None, by_blocks: bool):
    """A ``value`` handed narrower than ``dtype`` as an op reads it: a ``NarrowRead``
    for an op that reads it by blocks (``READERS``), else widened whole; ``dtype`` None:
    handed as read."""
    if dtype is None:
        return value
    return NarrowRead(value, dtype) if by_blocks else value.to(dtype)


def whole(value):
    """``value``, a ``NarrowRead`` read whole."""
    return value.whole() if isinstance(value, NarrowRead) else value


def call(target, args: tuple, kwargs: dict):
    """``target(*args, **kwargs)`` where some arguments are ``NarrowRead``."""
    if not kwargs and target in _BY_BLOCKS:
        found = _BY_BLOCKS[target](*args)
        if found is not None:
            return found
    args = tuple(whole(arg) for arg in args)
    return target(*args, **{key: whole(value) for key, value in kwargs.items()})


def _linear(x, weight, bias=None):
    """``linear`` by blocks of the weight's rows (output features)."""
    if not _blockable(weight, x) or weight.stored.dim() != 2 or isinstance(x, NarrowRead):
        return None
    bias = whole(bias)
    rows = max(1, BLOCK // max(1, weight.stored.shape[1]))
    buffer = torch.empty(min(rows, weight.stored.shape[0]), weight.stored.shape[1], dtype=x.dtype)
    parts = []
    for start in range(0, weight.stored.shape[0], rows):
        block = weight.stored[start : start + rows]
        read = weight.read(block, buffer[: block.shape[0]])
        part_bias = None if bias is None else bias[start : start + rows]
        parts.append(torch.nn.functional.linear(x, read, part_bias))
    return torch.cat(parts, dim=-1)


def _matmul(x, weight):
    """``mm``/``matmul`` with a 2-D weight second, by blocks of its columns."""
    if not _blockable(weight, x) or weight.stored.dim() != 2 or isinstance(x, NarrowRead):
        return None
    columns = max(1, BLOCK // max(1, weight.stored.shape[0]))
    buffer = torch.empty(
        weight.stored.shape[0], min(columns, weight.stored.shape[1]), dtype=x.dtype
    )
    parts = []
    for start in range(0, weight.stored.shape[1], columns):
        block = weight.stored[:, start : start + columns]
        parts.append(torch.matmul(x, weight.read(block, buffer[:, : block.shape[1]])))
    return torch.cat(parts, dim=-1)


def _embedding(weight, indices, *rest):
    """``embedding``: the rows gathered from the stored tensor, then widened."""
    if not isinstance(weight, NarrowRead) or isinstance(indices, NarrowRead):
        return None
    return weight.read(aten.embedding.default(weight.stored, indices, *rest))


def _blockable(weight, x) -> bool:
    return (
        isinstance(weight, NarrowRead)
        and isinstance(x, torch.Tensor)
        and x.dtype == weight.dtype
        and weight.stored.numel() > BLOCK
    )


_BY_BLOCKS = {
    aten.linear.default: _linear,
    aten.mm.default: _matmul,
    aten.matmul.default: _matmul,
    aten.embedding.default: _embedding,
}
READERS = frozenset(_BY_BLOCKS)
