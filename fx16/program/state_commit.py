"""Converting the state tensors a cast decided on (``Program.commit_state``).

Largest first, one at a time: each fp32 tensor is dropped as soon as its 16-bit copy
replaces it, so when fx16 holds the only reference, memory falls as the commit goes
on. A tensor stored under several names is converted once and stays shared. A tensor
of the other 16-bit dtype (a bf16 checkpoint's weight made fp16) that only the program
holds (no caller's model, no view shares its memory) is converted over its own memory,
where that memory is the process's own (``fx16.program.private_memory``: not a file
mapped shared): no memory is allocated for it at all.
"""

import sys
from collections.abc import Callable
from functools import partial

import torch
from tqdm import tqdm

from fx16.ops.numerics import conversion_scratch, convert_in_place, tensor_to_fp16
from fx16.program.private_memory import memory_map, written_privately
from fx16.program.snapshot import PENDING

# How many tensors use a storage (torch's private count; without it, nothing is
# converted in place).
_STORAGE_USES = getattr(torch._C, "_storage_Use_Count", None)
_UNREAD = object()


def convert_state_tensors(program, targets, convert) -> dict[str, torch.Tensor]:
    """Store ``convert(tensor)`` under each name in ``targets`` through ``program`` (a
    ``fx16.program.Program``), computed once per tensor: names that shared a tensor
    (tied weights) share its converted one. Returns the tensors replaced, by name."""
    done: dict[int, torch.Tensor] = {}
    replaced = {}
    for target in targets:
        tensor = program.state_tensor(target)
        if tensor is None:
            continue
        replaced[target] = tensor
        if id(tensor) not in done:
            done[id(tensor)] = program.replace_state_tensor(target, convert(tensor))
        else:
            program.replace_state_tensor(target, done[id(tensor)])
    return replaced


def commit_narrowing(program, meta: dict) -> dict[str, torch.dtype]:
    """Commit ``program``'s pending conversions (under its graph module's ``meta``)
    except the widenings, which stay pending; returns those: target -> the dtype the
    graph reads it in."""
    pending = meta.pop(PENDING, None) or {}
    widened = {
        target: dtype for target, (dtype, _) in pending.items() if _widens(program, target, dtype)
    }
    if widened:
        meta[PENDING] = {target: pending[target] for target in widened}
    commit_pending(program, {t: p for t, p in pending.items() if t not in widened}, False)
    return widened


def _widens(program, target: str, dtype: torch.dtype) -> bool:
    tensor = program.state_tensor(target)
    return tensor is not None and tensor.dtype.itemsize < dtype.itemsize


def commit_pending(
    program, pending: dict[str, tuple[torch.dtype, bool]], progress: bool | None
) -> None:
    """Store each tensor named in ``pending`` in the dtype it maps to (with whether a
    nonzero element may flush: ``tensor_to_fp16``'s ``may_flush``; a widening is exact),
    through ``program`` (a ``fx16.program.Program``: its ``state_tensor`` and
    ``replace_state_tensor``). ``progress``: a progress bar of the bytes converted on
    stderr (None: when stderr is a terminal)."""
    shared: dict[int, tuple[list[str], int]] = {}  # by tensor: its names, its bytes
    widths: dict[str, int] = {}  # each one's element size
    for target in pending:
        tensor = program.state_tensor(target)
        shared.setdefault(id(tensor), ([], _nbytes(tensor)))[0].append(target)
        widths[target] = tensor.element_size()
    tensor = None  # only names are held: each original can go as soon as it is replaced
    groups = sorted(shared.values(), key=lambda group: -group[1])
    alone = _held_alone()
    with tqdm(
        total=sum(nbytes for _, nbytes in groups),
        desc="fx16: converting weights",
        unit="B",
        unit_scale=True,
        leave=False,
        disable=None if progress is None else not progress,
    ) as bar:
        scratches = {}  # one per device for all: no temporaries between the copies
        mappings = _UNREAD  # the process's memory map, read for the first bf16 tensor
        for names, nbytes in groups:
            dtype, may_flush = pending[names[0]]
            # as wide (bf16 to fp16), one reference per name and none else (asked before
            # this loop holds one)
            in_place = (
                widths[names[0]] == dtype.itemsize
                and _convertible_in_place(partial(program.state_tensor, names[0]), dtype)
                and _held(partial(program.state_tensor, names[0]))
                == (alone[0] - 1 + len(names), alone[1])
            )
            if in_place:  # and its memory is the process's own (not a file mapped shared)
                if mappings is _UNREAD:
                    mappings = memory_map()
                in_place = written_privately(program.state_tensor(names[0]), mappings)
            original = program.state_tensor(names[0])
            if original.dtype.itemsize < dtype.itemsize:
                stored = original.detach().to(dtype)
            else:
                if original.device not in scratches:
                    scratches[original.device] = conversion_scratch(device=original.device)
                convert = convert_in_place if in_place else tensor_to_fp16
                stored = convert(original, dtype, scratches[original.device], may_flush)
            for target in names:
                stored = program.replace_state_tensor(target, stored)
            bar.update(nbytes)
            del original, stored  # fx16's last references to this tensor


def _convertible_in_place(get: Callable[[], torch.Tensor], dtype: torch.dtype) -> bool:
    """The tensor ``get()`` returns is a plain contiguous float tensor of another dtype as
    wide as ``dtype`` (a bf16 weight to be made fp16): its memory can hold the result."""
    tensor = get()
    return (
        _STORAGE_USES is not None
        and type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.is_floating_point()
        and tensor.dtype != dtype
        and tensor.element_size() == dtype.itemsize
        and tensor.is_contiguous()
    )


def _held(get: Callable[[], torch.Tensor]) -> tuple[int, int]:
    """(Python references to the tensor ``get()`` returns, tensors using its storage),
    each count with this call's own."""
    return sys.getrefcount(get()), _STORAGE_USES(get().untyped_storage()._cdata)


def _held_alone() -> tuple[int, int]:
    """``_held`` of a tensor one dict entry holds and no other tensor shares: what a
    state tensor shows when only the program holds it, counted the same way (a
    caller's model, a view of it or any other reference adds to it)."""
    probe = {"alone": torch.empty(1)}
    return _held(lambda: probe["alone"]) if _STORAGE_USES is not None else (0, 0)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
