"""fx16.program.narrow_reads: an op reading a bf16 tensor the graph reads as fp32
computes what it computes on the tensor widened whole, without the whole fp32 copy:
a product by blocks of its weight through one reused buffer, an embedding by its rows."""

from unittest import mock

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from fx16.program import narrow_reads
from fx16.program.narrow_reads import BLOCK, NarrowRead

aten = torch.ops.aten
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class _LargestFp32(TorchDispatchMode):
    """The largest fp32 tensor any op made."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == FP32:
            self.largest = max(self.largest, out.numel())
        return out


def _weight(rows: int, columns: int) -> torch.Tensor:
    torch.manual_seed(0)
    return (0.05 * torch.randn(rows, columns)).to(BF16)


@pytest.mark.parametrize("op", [aten.linear.default, aten.mm.default, aten.matmul.default])
def test_a_product_reads_its_weight_by_blocks_and_computes_the_widened_product(op):
    """A weight of 3 blocks and a bit: the product matches the one on the weight widened
    whole to fp32's rounding, and no fp32 tensor the size of the weight is ever made."""
    weight = _weight(3 * BLOCK // 512 + 7, 512)
    if op is not aten.linear.default:
        weight = weight.t().contiguous()
    x = torch.randn(2, 5, 512 if op is aten.linear.default else weight.shape[0])
    if op is aten.mm.default:
        x = x[0]
    args = (
        (x, weight.float(), torch.randn(weight.shape[0]))
        if op is aten.linear.default
        else (x, weight.float())
    )
    expected = op(*args)
    tracker = _LargestFp32()
    with tracker:
        got = narrow_reads.call(op, (x, NarrowRead(weight, FP32), *args[2:]), {})
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert BLOCK <= tracker.largest < weight.numel() / 2


def test_an_embedding_gathers_its_rows_then_widens_them():
    """The rows gathered from the bf16 table, widened: equal to the widened table's."""
    table, ids = _weight(1000, 64), torch.randint(0, 1000, (3, 7))
    tracker = _LargestFp32()
    with tracker:
        got = narrow_reads.call(aten.embedding.default, (NarrowRead(table, FP32), ids), {})
    assert torch.equal(got, aten.embedding.default(table.float(), ids))
    assert tracker.largest == ids.numel() * 64


def test_a_read_through_a_transform_transforms_each_block():
    """An emulation's rounding to fp16 on what a product reads: applied to each block,
    the product equals the one on the weight rounded whole."""
    weight, x = _weight(2 * BLOCK // 256 + 3, 256), torch.randn(4, 256)
    rounded = NarrowRead(weight, FP32).then(lambda t: t.half().float())
    got = narrow_reads.call(aten.linear.default, (x, rounded), {})
    expected = aten.linear.default(x, weight.float().half().float())
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_any_other_op_reads_it_widened_whole():
    """An op outside ``READERS`` (and a product with the narrow tensor first, or a
    small weight) gets the whole widened tensor: the same result as on it."""
    weight = _weight(16, 8)
    read = NarrowRead(weight, FP32)
    assert torch.equal(narrow_reads.call(aten.mul.Tensor, (read, 2.0), {}), weight.float() * 2)
    x = torch.randn(3, 8)
    assert torch.equal(
        narrow_reads.call(aten.linear.default, (x, read), {}),
        aten.linear.default(x, weight.float()),
    )
    assert torch.equal(
        narrow_reads.call(aten.mm.default, (read, torch.ones(8, 2)), {}),
        weight.float() @ torch.ones(8, 2),
    )
    assert narrow_reads.as_read(weight, None, True) is weight
    assert narrow_reads.as_read(weight, FP32, False).dtype == FP32


@settings(max_examples=examples(20), deadline=None)
@given(
    op=st.sampled_from([aten.linear.default, aten.mm.default, aten.matmul.default]),
    rows=st.integers(1, 97),
    columns=st.integers(1, 61),
    block=st.integers(8, 400),
    rounded=st.booleans(),
)
def test_property_a_product_by_blocks_is_the_product_on_the_weight_widened(
    op, rows, columns, block, rounded
):
    """Any weight shape and block size (a block smaller than a row included), read
    widened or through an emulation's rounding: the product by blocks matches the one on
    the whole tensor read the same way, to fp32's rounding, and no fp32 tensor of the
    weight's size is made where the weight spans more than a block."""
    torch.manual_seed(rows * 1000 + columns)
    weight = (0.05 * torch.randn(rows, columns)).to(BF16)
    x = torch.randn(3, columns if op is aten.linear.default else rows)
    transform = (lambda t: t.half().float()) if rounded else (lambda t: t)
    expected = op(x, transform(weight.float()))
    read = NarrowRead(weight, FP32).then(transform)
    tracker = _LargestFp32()
    with mock.patch.object(narrow_reads, "BLOCK", block), tracker:
        got = narrow_reads.call(op, (x, read), {})
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if weight.numel() > 2 * block + rows + columns:
        assert tracker.largest < weight.numel()
