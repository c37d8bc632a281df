"""``fx16.program.private_memory``: which tensors' memory a conversion in place may
write over (the process's own), and which it must not (a file or another process would
see the write, or the memory is read-only)."""

import mmap
import sys

import pytest
import torch

from fx16.program.private_memory import memory_map, written_privately

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")


def _file_tensor(path, shared: bool) -> torch.Tensor:
    path.write_bytes(bytes(4096 * 3))
    storage = torch.UntypedStorage.from_file(str(path), shared, 4096 * 3)
    return torch.empty(0, dtype=torch.bfloat16).set_(storage, 0, (4096 * 3 // 2,))


@linux_only
def test_memory_the_process_owns_alone_is_written_privately(tmp_path):
    """Memory torch's allocator gave (small, from the heap; large, mapped anonymously)
    and a file mapped copy-on-write: a write changes only the process's own pages."""
    small, large = torch.empty(16, dtype=torch.bfloat16), torch.empty(1 << 22)
    private = _file_tensor(tmp_path / "private.bin", shared=False)
    mappings = memory_map()
    assert all(written_privately(t, mappings) for t in (small, large, private))


@linux_only
def test_memory_others_see_or_none_may_write_is_not(tmp_path):
    """A file mapped shared (the file would change), memory shared with other processes
    (``share_memory_``), a read-only mapping: none is written privately."""
    shared = _file_tensor(tmp_path / "shared.bin", shared=True)
    between_processes = torch.zeros(1 << 16).share_memory_()
    (tmp_path / "read.bin").write_bytes(bytes(8192))
    with open(tmp_path / "read.bin", "rb") as file:
        read_only = mmap.mmap(file.fileno(), 8192, prot=mmap.PROT_READ)
    with pytest.warns(UserWarning, match="not writable"):
        unwritable = torch.frombuffer(read_only, dtype=torch.bfloat16)
    mappings = memory_map()
    for tensor in (shared, between_processes, unwritable):
        assert not written_privately(tensor, mappings)
    del unwritable


def test_without_a_memory_map_only_the_allocators_own_unshared_memory_is(tmp_path):
    """Where the system lists no mappings: memory torch's allocator gave, not shared."""
    assert written_privately(torch.empty(1 << 20), None)
    assert not written_privately(torch.zeros(16).share_memory_(), None)
    assert not written_privately(_file_tensor(tmp_path / "private.bin", shared=False), None)
