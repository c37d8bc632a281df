"""Ranges proven by use: a value indexing a dimension of size N lies in [-N, N-1]."""

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fx16.analysis import ValueRangeAnalysis
from fx16.program import Program
from helpers import export


def _ranges(ep):
    ValueRangeAnalysis(Program(ep))(ep.graph_module)
    found = {n.name: n.meta.get(ValueRangeAnalysis.META_KEY) for n in ep.graph_module.graph.nodes}
    return {name: (r.low, r.high) if r is not None else None for name, r in found.items()}


class StaticCache(nn.Module):
    """Writes at cache_position and start + arange(n), then uses the position as a float."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2048, 4))

    def forward(self, x, cache_position):
        start = cache_position[0]
        slots = torch.arange(x.shape[0]) + start
        self.cache.index_copy_(0, slots, x)
        return self.cache.sum() + cache_position.float().sum()


def test_a_cache_position_gets_the_cache_length_as_its_proven_range():
    ranges = _ranges(export(StaticCache(), torch.randn(1, 4), torch.tensor([5])))
    assert ranges["add"] == (0, 2047)  # the slots written (index_copy_ takes no negatives)
    assert ranges["cache_position"] == (0, 2047)  # shifted back through + arange(1)


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(100, 4)

    def forward(self, ids, other):
        picked = torch.index_select(self.table.weight, 0, other)  # other in [0, 99]
        return (
            self.table(ids.view(-1))
            + picked
            + self.table.weight[:50].index_fill(0, other, 0.0).sum()
        )


def test_embedding_ids_are_non_negative_and_several_uses_intersect():
    ranges = _ranges(export(Lookup(), torch.tensor([[1, 2]]), torch.tensor([3, 4])))
    assert ranges["ids"] == (0, 99)  # through the view
    assert ranges["other"] == (0, 49)  # and in [-50, 49] for index_fill


class Unused(nn.Module):
    def forward(self, position):
        return position * 2


def test_a_value_no_index_reads_stays_unknown():
    assert _ranges(export(Unused(), torch.tensor([3])))["position"] is None


class Cache(nn.Module):
    def __init__(self, slots):
        super().__init__()
        self.register_buffer("cache", torch.zeros(slots, 2))

    def forward(self, x, start):
        self.cache.index_copy_(0, torch.arange(x.shape[0]) + start[0], x)
        return self.cache.sum()


@settings(max_examples=examples(10), deadline=None)
@given(st.integers(2, 5000), st.integers(1, 4))
def test_property_every_valid_start_lies_in_the_proven_range(slots, written):
    written = min(written, slots)
    ep = export(Cache(slots), torch.randn(written, 2), torch.tensor([0]))
    low, high = _ranges(ep)["start"]
    # each slot start + i (i < written) lies in [0, slots - 1], interval by interval
    assert (low, high) == (1 - written, slots - 1)
    for start in (0, slots - written):  # valid calls run, and lie in the range
        Cache(slots)(torch.randn(written, 2), torch.tensor([start]))
        assert low <= start <= high
