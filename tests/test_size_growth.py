"""Values that grow with a dynamic size are judged at the size's bound
(``fx16.analysis.size_growth``): a cast calibrated at 16 tokens holds at the longest
input the program accepts, and the envelope names the lengths."""

import copy
import re

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.export import Dim

import fx16
from benchmarks.range_flows import BagOfEmbeddings
from fx16 import meta
from fx16.analysis.size_growth import UNBOUNDED_LENGTH
from fx16.report import report_of
from helpers import check_program, node_named


class WeightedMean(nn.Module):
    """Scores softmaxed over the tokens, then the weighted mean and the plain mean of
    the token features: both stay the size of one token's."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.head = nn.Linear(16, 1), nn.Linear(16, 4)

    def forward(self, x):
        weights = torch.softmax(self.score(x).transpose(1, 2), dim=-1)
        return self.head((weights @ x).squeeze(1) + x.mean(1))


def _export(model, example, dim):
    return torch.export.export(model, (example,), dynamic_shapes=({1: dim},))


def _relative_error(model, ep, x) -> float:
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x if not x.is_floating_point() else x.double())
        got = ep.module()(x if not x.is_floating_point() else x.half()).double()
    return float((got - reference).abs().max() / reference.abs().max())


def test_a_sum_over_a_dynamic_length_is_judged_at_its_bound():
    """Input: embedding -> sum over ``seq`` (Dim max 4096) -> linear, calibrated at 16
    tokens (sums up to ~410). Output: the sum judged at 4096 tokens (256x: ~1.1e5, past
    fp16's range) and carried at a power of two, so the cast holds at every length up
    to the bound (before: NaN at 4096, where fp32 is finite), still every FLOP 16-bit;
    the envelope names the length."""
    torch.manual_seed(0)
    model = BagOfEmbeddings().eval()
    ep = _export(model, torch.randint(0, 100, (2, 16)), Dim("seq", min=2, max=4096))
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    factor, lengths, _ = node_named(ep, "sum_1").meta[meta.SIZE_GROWTH]
    assert factor == 4096 / 16 and lengths == "ids.shape[1] at 4096 (its bound, calibrated at 16)"
    for length in (16, 1024, 4096):
        ids = torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(length))
        assert _relative_error(model, ep, ids) < 4 * 2.0**-11, length
    report = report_of(ep)
    assert report.totals.product_flops_16bit == report.totals.product_flops
    assert any(
        "dynamic sizes" in line and "ids.shape[1] at 4096" in line
        for line in report.totals.envelope.lines()
    )


def test_a_length_nothing_bounds_is_judged_at_the_stated_default():
    torch.manual_seed(0)
    model = BagOfEmbeddings().eval()
    ep = _export(model, torch.randint(0, 100, (2, 16)), Dim("seq", min=2))
    fx16.cast_fp32_to_fp16(ep)
    factor, lengths, _ = node_named(ep, "sum_1").meta[meta.SIZE_GROWTH]
    assert factor == UNBOUNDED_LENGTH / 16 and "unbounded" in lengths


def test_softmax_weights_and_means_over_a_dynamic_length_do_not_grow():
    """A contraction with weights that sum to one over the length, and a mean over it,
    are as large at any length: nothing is judged larger than calibration saw."""
    torch.manual_seed(0)
    model = WeightedMean().eval()
    ep = _export(model, torch.randn(2, 16, 16), Dim("seq", min=2, max=4096))
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    assert not [n for n in ep.graph.nodes if meta.SIZE_GROWTH in n.meta]
    assert not ep.graph_module.meta.get(meta.DYNAMIC_LENGTHS)


def test_a_static_program_is_judged_as_calibrated():
    torch.manual_seed(0)
    model = BagOfEmbeddings().eval()
    ep = torch.export.export(model, (torch.randint(0, 100, (2, 16)),))
    fx16.cast_fp32_to_fp16(ep)
    assert not [n for n in ep.graph.nodes if meta.SIZE_GROWTH in n.meta]
    assert not any("dynamic sizes" in line for line in report_of(ep).totals.envelope.lines())


class BagIntoExp(BagOfEmbeddings):
    """The bag's sums read by an exponential (no scale carries them): fp32 for range."""

    def forward(self, ids):
        return torch.exp(self.embed(ids).sum(1) / 64.0 * 0.05)


def test_a_value_judged_at_a_bound_says_so_in_its_row():
    """Input: sums over ``seq`` (Dim max 4096) -> exp, calibrated at 16 tokens. The sum is
    judged at 4096 tokens, past fp16's range; its row says the figure is the bound's,
    with what calibration observed beside it (not a figure calibration never saw)."""
    torch.manual_seed(0)
    model = BagIntoExp().eval()
    ep = _export(model, torch.randint(0, 100, (2, 16)), Dim("seq", min=2, max=4096))
    fx16.cast_fp32_to_fp16(ep)
    grown = [row for row in report_of(ep).rows if "judged at ids.shape[1] at 4096" in row.detail]
    assert grown and all(re.search(r"observed \d", row.detail) for row in grown)


@settings(max_examples=examples(6), deadline=None)
@given(st.integers(2, 64), st.sampled_from([256, 1024, 4096]))
def test_property_a_sum_is_judged_at_its_bound_for_any_calibrated_length(calibrated, bound):
    """Calibrated at any length up to 64, a bag of embeddings with any bound: the sum is
    judged at bound / calibrated times what was seen, and the cast holds at the bound."""
    torch.manual_seed(0)
    model = BagOfEmbeddings().eval()
    ids = torch.randint(0, 100, (2, calibrated), generator=torch.Generator().manual_seed(bound))
    ep = _export(model, ids, Dim("seq", min=2, max=bound))
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    factor, _, _ = node_named(ep, "sum_1").meta[meta.SIZE_GROWTH]
    assert factor == bound / calibrated
    longest = torch.randint(0, 100, (2, bound), generator=torch.Generator().manual_seed(1))
    assert _relative_error(model, ep, longest) < 4 * 2.0**-11
