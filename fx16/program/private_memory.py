"""Whether a tensor's memory is this process's own to write over.

A bf16 weight converted to fp16 in place (``fx16.program.state_commit``) must not
write through to anything but the weight: not to a checkpoint file mapped shared
(``torch.load(mmap=True)`` with ``MAP_SHARED``, ``UntypedStorage.from_file(shared=True)``:
the file on disk would change), not to memory another process maps
(``share_memory_``), not to memory mapped read-only (the write would crash). On Linux
the process's own map (``/proc/self/maps``) says how each range is mapped; a private
copy-on-write mapping of a file is written in the process's own pages, never in the file.
"""

import bisect
from pathlib import Path

import torch

_MAPS = Path("/proc/self/maps")

Mapping = tuple[int, int, str]  # start, end, permissions ("rw-p")


def memory_map() -> list[Mapping] | None:
    """This process's mappings, sorted by address; None where the system lists none."""
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return None
    mappings = []
    for line in lines:
        span, permissions = line.split(maxsplit=2)[:2]
        start, end = span.split("-")
        mappings.append((int(start, 16), int(end, 16), permissions))
    return sorted(mappings)


def written_privately(tensor: torch.Tensor, mappings: list[Mapping] | None) -> bool:
    """Whether writing over ``tensor``'s whole storage changes nothing but it: on the CPU,
    the storage lies wholly in private writable mappings (``mappings``, from
    ``memory_map``; where there are none, only memory torch's allocator gave and did
    not share); on another device, memory its allocator gave."""
    storage = tensor.untyped_storage()
    if storage.device.type != "cpu" or mappings is None:
        return storage.resizable() and not (storage.device.type == "cpu" and storage.is_shared())
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    if start == end:
        return False
    index = bisect.bisect_right(mappings, (start, float("inf"), "")) - 1
    while start < end:
        if index < 0 or index >= len(mappings):
            return False
        low, high, permissions = mappings[index]
        if not low <= start < high or permissions[1] != "w" or permissions[3] != "p":
            return False
        start, index = high, index + 1
    return True
