"""RoutingAnalysis and the index rule: a selection's indices are always valid, so only the
router itself is the policy's to keep in fp32, never what computes its input."""

import pytest
import torch
from torch import nn

import fx16
from fx16.analysis import RoutingAnalysis, UnsafeIndexAnalysis
from fx16.errors import InvalidOptionError
from fx16.program import Program
from fx16.report import report_of
from helpers import check_program, export, max_error, run


class TinyMoE(nn.Module):
    """A block computes h; a gate scores 4 experts; the top-2 experts' outputs, weighted
    by their scores, are summed."""

    def __init__(self, width=64, experts=4):
        super().__init__()
        self.block = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, width, width) / width**0.5)

    def forward(self, x):
        h = self.block(x)
        weights, chosen = self.gate(h).softmax(-1).topk(2, dim=-1)
        expert = self.experts[chosen]  # (tokens, 2, width, width)
        return (weights[..., None] * torch.einsum("td,tkde->tke", h, expert)).sum(1)


class GreedyStep(nn.Module):
    """One greedy decoding step: an MLP's logits, argmax, the chosen token's embedding."""

    def __init__(self, width=32, vocab=256):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, vocab)
        self.embed = nn.Embedding(vocab, width)

    def forward(self, x):
        return self.embed(self.head(self.mlp(x)).argmax(-1))


def _rules(ep):
    return {row.node: row.rule for row in report_of(ep).rows}


def test_the_index_rule_stops_at_a_selection():
    """topk's indices pick the experts: marked; the scores they compare are not."""
    ep = export(TinyMoE(), torch.randn(8, 64))
    UnsafeIndexAnalysis()(ep.graph_module)
    marks = {n.name: n.meta[UnsafeIndexAnalysis.META_KEY] for n in ep.graph_module.graph.nodes}
    assert marks["getitem_1"]  # the chosen experts
    assert not marks["softmax"] and not marks["linear_2"] and not marks["linear"]


def test_by_default_the_router_is_fp32_and_nothing_upstream():
    """gate (a product under 1% of the FLOPs), softmax, topk: fp32 by the policy; the
    block before them and the experts after them: 16-bit."""
    torch.manual_seed(0)
    model, x = TinyMoE().eval(), torch.randn(64, 64)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    rules = _rules(ep)
    assert rules["linear_2"] == rules["softmax"] == rules["topk"] == "router"
    assert rules["linear"] == rules["linear_1"] == rules["einsum"] == "fits"
    assert report_of(ep).totals.flop_share_16bit > 0.99
    assert max_error([model(x)], run(ep, x)) < 1e-2


def test_routing_16_bit_keeps_nothing_in_fp32():
    torch.manual_seed(0)
    ep = fx16.cast_fp32_to_fp16(
        export(TinyMoE().eval(), torch.randn(64, 64)),
        policy=fx16.PrecisionPolicy.default(routing="16-bit"),
    )
    assert "router" not in _rules(ep).values()
    assert report_of(ep).totals.flop_share_16bit == 1.0


def test_a_decoders_vocabulary_head_stays_16_bit():
    """argmax -> embedding: the argmax is a router, the head (most of the FLOPs) is not."""
    torch.manual_seed(0)
    model, x = GreedyStep().eval(), torch.randn(16, 32)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    rules = _rules(ep)
    assert rules["argmax"] == "router"
    assert all(rules[name] == "fits" for name in ("linear", "linear_1", "linear_2"))
    totals = report_of(ep).totals
    assert totals.flop_share_16bit == 1.0 and totals.fp32_weight_bytes == 0


def test_a_selection_that_decides_no_index_is_no_router():
    class TopValues(nn.Module):
        def forward(self, x):
            return x.topk(2, dim=-1).values.sum(-1)

    ep = export(TopValues(), torch.randn(4, 8))
    program = Program(ep)
    UnsafeIndexAnalysis()(ep.graph_module)
    RoutingAnalysis(program)(ep.graph_module)
    assert not any(RoutingAnalysis.META_KEY in n.meta for n in ep.graph_module.graph.nodes)


def test_a_float_turned_into_an_index_by_conversion_is_still_kept():
    """round(x * 10).long() -> embedding: the conversion's exact float matters."""

    class Bucketed(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 4)

        def forward(self, x):
            return self.embed((x.sigmoid() * 63).round().long())

    ep = fx16.cast_fp32_to_fp16(export(Bucketed(), torch.randn(4, 8)))
    rules = _rules(ep)
    assert rules["sigmoid"] == rules["mul"] == rules["round_1"] == "unsafe_index"


def test_an_unknown_routing_is_refused():
    with pytest.raises(InvalidOptionError, match="routing must be one of"):
        fx16.PrecisionPolicy.default(routing="bf16")
