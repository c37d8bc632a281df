"""SentinelFillsPass: a mask's fill far beyond the scores it replaces (-1e9) is carried as
an infinity-like sentinel, as ``finfo(float32).min`` is: no scale domain, no fp32 op;
fills that are not sentinels stay as they are."""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from benchmarks.range import MaskedScores
from fx16 import meta
from fx16.analysis.scale_domains import scale_domains
from fx16.pipelines import run_passes
from fx16.program.stats import program_stats
from fx16.report import report_of
from helpers import check_program, export, fp64_reference, max_error, run


def _inputs():
    torch.manual_seed(0)
    mask = torch.rand(4, 12) > 0.3
    mask[:, 0] = True  # every row keeps one score
    return torch.randn(4, 16), mask


def _fills(ep) -> list:
    return [n for n in ep.graph_module.graph.nodes if meta.sentinel_fill(n)]


@pytest.mark.parametrize("how", ["masked_fill", "where"])
def test_a_fill_far_beyond_the_scores_is_a_sentinel(how):
    """Input graph: linear -> masked_fill(~mask, -1e9) (or where) -> softmax. Output:
    the fill is 1e38 (saturated in fp16), no scale domain, no fp32 op, the report says
    why; softmax's result within 16-bit rounding of fp64."""
    x, mask = _inputs()
    model = MaskedScores(how=how).eval()
    ep = fx16.cast_fp32_to_fp16(export(model, x, mask))
    check_program(ep)
    (fill,) = _fills(ep)
    assert "-1e+09 fills for minus/plus infinity" in meta.sentinel_fill(fill)
    assert not scale_domains(ep.graph_module)
    assert program_stats(ep).ops_in(torch.float32) == 0
    rows = {row.node: row for row in report_of(ep).rows}
    assert "fills for minus/plus infinity" in rows[fill.name].why()
    assert max_error(fp64_reference(model, x, mask), run(ep, x, mask)) < 4 * 2.0**-11


def test_the_rewritten_fp32_program_computes_the_same():
    """Before any 16-bit decision, the program with its fill as 1e38 gives the original's
    softmax bit for bit: every masked score was already exp's zero."""
    x, mask = _inputs()
    model = MaskedScores().eval()
    ep = export(model, x, mask)
    passes = fx16.fp16_passes(ep)
    stages = [type(p).__name__ for p in passes]
    run_passes(passes[: stages.index("SentinelFillsPass") + 1], ep.graph_module)
    assert _fills(ep)
    with torch.no_grad():
        assert torch.equal(ep.module()(x, mask), model(x, mask))


@pytest.mark.parametrize(
    "options",
    [
        {"scale": 1e4},  # scores up to ~1e4: -1e9 is not 2**20 beyond them
        {"how": "add"},  # full_like * mask: a multiply does not absorb it
    ],
    ids=["scores_near_the_fill", "multiplied"],
)
def test_a_fill_that_is_not_a_sentinel_is_left_as_it_is(options):
    """A fill near the values it replaces, or one a use does not absorb (multiplied
    before it is added), is the model's number: not rewritten."""
    x, mask = _inputs()
    ep = fx16.cast_fp32_to_fp16(export(MaskedScores(**options).eval(), x, mask))
    check_program(ep)
    assert not _fills(ep)


class Summed(MaskedScores):
    def forward(self, x, mask):
        return self.scores(x).masked_fill(~mask, self.fill).sum(-1)


def test_a_fill_a_sum_reads_is_not_a_sentinel():
    """Input graph: masked_fill(-1e9) -> sum: the sum sees the -1e9 itself."""
    x, mask = _inputs()
    model = Summed().eval()
    ep = fx16.cast_fp32_to_fp16(export(model, x, mask))
    assert not _fills(ep)
    assert max_error(fp64_reference(model, x, mask), run(ep, x, mask)) < 1e-3


@settings(max_examples=examples(12), deadline=None)
@given(
    st.sampled_from([-1e5, -1e7, -1e9, -1e12, 1e9]),
    st.sampled_from([0.1, 1.0, 30.0, 3e3]),
    st.sampled_from(["masked_fill", "where"]),
)
def test_property_a_fill_is_a_sentinel_exactly_when_far_beyond_and_changes_nothing(
    fill, scale, how
):
    """Fills beyond fp16 of either sign, scores of any size: the fill is rewritten
    exactly when it lies 2**20 beyond the scores, and the rewritten fp32 program gives
    the original's softmax bit for bit (every masked element was already exp's zero)."""
    x, mask = _inputs()
    model = MaskedScores(fill, how, scale).eval()
    ep = export(model, x, mask)
    passes = fx16.fp16_passes(ep)
    stages = [type(p).__name__ for p in passes]
    run_passes(passes[: stages.index("SentinelFillsPass") + 1], ep.graph_module)
    with torch.no_grad():
        scores = model.scores(x).abs().max() * scale
        assert bool(_fills(ep)) == (abs(fill) >= scores * 2.0**20)
        assert torch.equal(ep.module()(x, mask), model(x, mask))
