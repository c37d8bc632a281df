"""fx16.program.casts: recognising casts, exact-representation facts, and the cast inserter."""

import pytest
import torch

from fx16.program.casts import INSERTED, CastInserter, cast_dtype, is_cast, represents_exactly
from helpers import export

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


@pytest.mark.parametrize(
    "narrow, wide, exact",
    [
        (F16, F32, True),
        (BF16, F32, True),
        (F32, F64, True),
        (F16, BF16, False),
        (BF16, F16, False),
        (F32, F16, False),
        (torch.int16, F32, True),
        (torch.int16, F16, False),
        (torch.int32, F32, False),
        (torch.int32, F64, True),
        (torch.int8, F16, True),
        (torch.uint8, BF16, True),
        (torch.bool, F16, True),
        (torch.int16, torch.int32, True),
        (torch.int32, torch.int16, False),
        (torch.uint8, torch.int8, False),
        (F16, torch.int32, False),
    ],
)
def test_represents_exactly(narrow, wide, exact):
    assert represents_exactly(narrow, wide) is exact


def test_exactness_claims_hold_on_every_value():
    """Every int16 value survives fp32; not every fp32 value survives fp16."""
    values = torch.arange(-32768, 32768, dtype=torch.int16)
    assert torch.equal(values.to(F32).to(torch.int16), values)
    assert not torch.equal(torch.tensor([0.1]).half().float(), torch.tensor([0.1]))


class Casts(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float16), x.to(torch.float32, copy=True), x.double()


def test_only_pure_dtype_casts_count():
    ep = export(Casts(), torch.randn(2))
    conversions = [n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.to.dtype]
    assert [is_cast(n) for n in conversions] == [True, False, True]  # copy=True is a copy


def test_inserter_places_one_cast_per_producer_after_the_placeholders():
    ep = export(Casts(), torch.randn(2))
    graph = ep.graph_module.graph
    x = next(iter(graph.nodes))
    inserter = CastInserter(graph)
    first = inserter.cast(x, F16, "narrow")
    assert inserter.cast(x, F16, "narrow") is first
    assert first.meta[INSERTED] == "narrow" and cast_dtype(first) == F16
    assert first.meta["val"].dtype == F16 and first.meta["val"].shape == x.meta["val"].shape
    assert first.prev.op == "placeholder"
    graph.lint()
