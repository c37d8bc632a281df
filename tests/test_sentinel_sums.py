"""SentinelSumsPass: ``scores + mask`` keeps the mask's -1e38 wherever the mask holds it,
in fp16 as in fp32, so a row masked whole (a padded query) gets equal weights, not nan;
sums fp16 absorbs anyway, and bf16 programs, are left as they are."""

import math

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.passes import SentinelSumsPass
from fx16.passes.sentinel_sums import RULE, absorbed_below
from fx16.pipelines import run_passes
from fx16.program.stats import program_stats
from fx16.report import report_of
from fx16.testing.checks import check_outputs
from helpers import check_program, export, fp64_reference, max_error, run

MIN = torch.finfo(torch.float32).min


class PaddedAttention(nn.Module):
    """Two attention layers over a left-padded batch, the additive mask built as
    Hugging Face models build it (causal and padding, ``finfo.min`` where masked): a
    padded query sees only padded keys, its row masked whole. ``loudness`` scales the
    query weights as trained models' are (scores of tens, not of one)."""

    def __init__(self, width: int = 16, layers: int = 2, loudness: float = 16.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(layers))
        with torch.no_grad():
            for linear in self.qkv:
                linear.weight[:width] *= loudness

    def forward(self, x, keep):
        length = x.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        allowed = causal[None, None] & keep[:, None, None, :]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, MIN)
        for linear in self.qkv:
            q, k, v = linear(x).chunk(3, dim=-1)
            scores = q[:, None] @ k[:, None].transpose(-1, -2) / math.sqrt(q.shape[-1])
            x = x + (torch.softmax(scores + mask, dim=-1) @ v[:, None])[:, 0]
        return x


def _inputs():
    torch.manual_seed(1)
    x = torch.randn(2, 6, 16)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, :2] = False  # left padding: the second sequence's first two queries see nothing
    return x, keep


def _rewritten(ep) -> list:
    return [n for n in ep.graph_module.graph.nodes if (meta.stabilized(n) or ("",))[0] == RULE]


def test_a_padded_query_keeps_equal_weights_instead_of_nan():
    """Input graph: two layers of (q k^T / sqrt(d) + mask) -> softmax -> @ v, scores of
    tens, one query row masked whole. Output: each mask sum is
    ``where(mask + scores * 0 <= -1e38, mask, sum)`` (the report says why), nothing is
    fp32, and the outputs hold 16-bit rounding of fp64 (before: 0.25 off: -65504 did not
    absorb the padded row's scores, whose softmax replaced fp32's equal weights; scores
    all below -16 would make that row -inf, its softmax nan)."""
    x, keep = _inputs()
    model = PaddedAttention().eval()
    ep = fx16.cast_fp32_to_fp16(export(model, x, keep))
    check_program(ep)
    rewritten = _rewritten(ep)
    assert len(rewritten) == 2
    assert all(n.target is torch.ops.aten.where.self for n in rewritten)
    rows = {row.node: row for row in report_of(ep).rows}
    assert rows[rewritten[0].name].stabilized.startswith(f"{RULE}: ")
    assert "absorbs" in rows[rewritten[0].name].stabilized
    assert program_stats(ep).ops_in(torch.float32) == 0
    (got,) = run(ep, x, keep)
    assert bool(torch.isfinite(got).all())
    assert max_error(fp64_reference(model, x, keep), [got]) < 8 * 2.0**-11


def test_the_rewritten_fp32_program_computes_the_same():
    """Before any 16-bit decision, the program with its sums rewritten gives the
    original's outputs bit for bit: in fp32 the sum already is the mask where the mask
    holds -3.4e38."""
    x, keep = _inputs()
    model = PaddedAttention().eval()
    ep = export(model, x, keep)
    run_passes([CalibrationAnalysis(ep), SentinelSumsPass()], ep.graph_module)
    ep.graph_module.recompile()
    assert _rewritten(ep)
    with torch.no_grad():
        assert torch.equal(ep.module()(x, keep), model(x, keep))


class MaskedSum(nn.Module):
    """``scores * 1.0 + mask``, the mask ``sentinel`` where ``allowed`` is False."""

    def __init__(self, sentinel: float) -> None:
        super().__init__()
        self.sentinel = sentinel

    def forward(self, scores, allowed):
        return scores * 1.0 + torch.zeros(allowed.shape).masked_fill(~allowed, self.sentinel)


def test_an_inf_or_nan_score_at_a_masked_place_gives_what_fp32_gives():
    """A score of inf, -inf or nan where the mask holds -3.4e38: fp32's sum is inf or
    nan there, and so is the rewritten program's, as everywhere else, bit for bit
    (long-fuzz finding: ``x.half().float()`` of 76,506 is inf, which the rewrite had
    replaced with the mask)."""
    scores = torch.tensor([[2500.0, math.inf, -math.inf, math.nan, -30.0, 3.0]])
    allowed = torch.tensor([[True, False, False, False, False, True]])
    ep = export(MaskedSum(MIN), scores, allowed)
    with torch.no_grad():
        expected = ep.module()(scores, allowed)
    run_passes([CalibrationAnalysis(ep), SentinelSumsPass()], ep.graph_module)
    ep.graph_module.recompile()
    assert _rewritten(ep)
    with torch.no_grad():
        got = ep.module()(scores, allowed)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert not bool(torch.isfinite(got[0, 1:4]).any())


def test_a_sum_guarded_already_is_left_as_it_is():
    """The pass run again on its own result (a program cast twice: the second
    calibration still sees the mask's -3.4e38 and the scores beyond 16) changes
    nothing: each sum keeps the one ``where`` it got (long fuzz, ``test_6``: an arange
    mask times ``finfo.min`` was wrapped in a second ``where`` on the second cast)."""
    x, keep = _inputs()
    ep = export(PaddedAttention().eval(), x, keep)
    run_passes([CalibrationAnalysis(ep), SentinelSumsPass()], ep.graph_module)
    ep.graph_module.recompile()
    code, nodes = ep.graph_module.code, len(ep.graph_module.graph.nodes)
    assert len(_rewritten(ep)) == 2
    assert not run_passes([CalibrationAnalysis(ep), SentinelSumsPass()], ep.graph_module)
    ep.graph_module.recompile()
    assert len(ep.graph_module.graph.nodes) == nodes and ep.graph_module.code == code


@pytest.mark.parametrize("entry", [fx16.cast_fp32_to_fp16, fx16.cast_to_16_bit_precision])
def test_a_padded_attention_cast_twice_equals_cast_once(entry):
    """The whole cast again on its own result: the same code and state, one ``where``
    per mask sum (before: each sum got a second one)."""
    x, keep = _inputs()
    ep = export(PaddedAttention().eval(), x, keep)
    entry(ep)
    code, state = ep.graph_module.code, dict(ep.state_dict)
    entry(ep)
    assert ep.graph_module.code == code and ep.state_dict.keys() == state.keys()
    assert all(torch.equal(ep.state_dict[name], tensor) for name, tensor in state.items())
    assert len(_rewritten(ep)) == 2


def test_the_rewrite_takes_the_sums_observations():
    """The ``where`` holds what calibration saw of the sum it replaces (the same
    values), no second calibration run: its magnitude and sentinel are the sum's; the
    comparison's ``mask + scores * 0`` holds the mask's, ``scores * 0`` zeros."""
    x, keep = _inputs()
    ep = export(PaddedAttention().eval(), x, keep)
    run_passes([CalibrationAnalysis(ep), SentinelSumsPass()], ep.graph_module)
    for kept in _rewritten(ep):
        total = kept.args[2]
        assert total.target is torch.ops.aten.add.Tensor
        assert meta.observed_max_abs(kept) == meta.observed_max_abs(total)
        assert meta.holds_sentinel(kept)
        compared = kept.args[0].args[0]  # mask + scores * 0: the mask's values
        mask, zeroed = compared.args
        assert meta.holds_sentinel(compared) and meta.holds_sentinel(mask)
        assert meta.observed_max_abs(compared) == meta.observed_max_abs(mask)
        assert meta.observed_max_abs(zeroed) == 0.0


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_sums_the_saturated_sentinel_absorbs_are_left_as_they_are(low):
    """Scores of about one (fp16's -65504 absorbs anything below 16), or any scores in
    bf16 (its saturated sentinel is fp32's): no rewrite, the program as before."""
    x, keep = _inputs()
    loudness = 0.05 if low == torch.float16 else 16.0
    model = PaddedAttention(loudness=loudness).eval()
    policy = "default" if low == torch.float16 else "auto_mixed_bf16"
    ep = fx16.cast_fp32_to_fp16(export(model, x, keep), policy=policy)
    check_program(ep)
    assert not _rewritten(ep)
    assert bool(torch.isfinite(run(ep, x, keep)[0]).all())


def test_what_fp16_absorbs():
    """fp16's -65504 absorbs an addend below 16 (half an ulp of its maximum) and not
    one of 16: the pass's reach is that over the overflow margin."""
    assert absorbed_below(torch.float16) == 16.0
    top = torch.tensor(-65504.0, dtype=torch.float16)
    assert (top + torch.tensor(-15.9, dtype=torch.float16)).item() == -65504.0
    assert (top + torch.tensor(16.0, dtype=torch.float16)).item() != -65504.0
    assert SentinelSumsPass(overflow_margin=4.0).reach == 4.0


class MaskedWholly(nn.Module):
    """softmax(x + full(finfo.min)): every row masked whole (the fuzzer's program)."""

    def forward(self, x):
        return torch.softmax(x + torch.full(x.shape, MIN), dim=-1)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_row_masked_whole_is_uniform_as_in_fp32(sign):
    """Inputs of thousands, either sign: fp32's softmax is 1/n everywhere; so is the
    cast's (before: -inf sums gave nan, or +2,500 left the scores' own softmax)."""
    x = sign * (torch.rand(3, 4) * 2500 + 1000)
    ep = fx16.cast_fp32_to_fp16(export(MaskedWholly(), x))
    check_program(ep)
    assert torch.equal(run(ep, x)[0].float(), torch.full((3, 4), 0.25))


class MaskKeptWide(nn.Module):
    """A mask some use of which cannot take a saturated sentinel (``abs``) is kept fp32;
    the sum and select that read it then hold -3.4e38 in fp32."""

    def forward(self, x, keep):
        mask = torch.zeros(x.shape).masked_fill(~keep, MIN)
        chosen = torch.where(mask.abs() >= 1e38, mask, x + mask)
        return torch.softmax(chosen, dim=-1)


def test_an_fp32_value_holding_a_sentinel_is_not_cast_down():
    """A 16-bit softmax reading an fp32 value that holds -3.4e38 would read -inf (a cast
    does not saturate), and a row masked whole would be nan: the value gets no 16-bit
    copy (the decision says why), its reader computes fp32, the rows are fp32's."""
    torch.manual_seed(0)
    x, keep = torch.randn(4, 4) * 2500, torch.rand(4, 4) > 0.5
    keep[0] = False
    model = MaskKeptWide()
    ep = fx16.cast_fp32_to_fp16(export(model, x, keep))
    check_program(ep)
    skipped = [
        meta.planned(n).cast_back_skipped for n in ep.graph_module.graph.nodes if meta.planned(n)
    ]
    assert any("sentinel" in why for why in skipped)
    with torch.no_grad():
        assert torch.allclose(run(ep, x, keep)[0].float(), model(x, keep), atol=1e-3)


def test_the_rewrite_is_in_the_saved_report(tmp_path):
    """Saved and loaded, the cast program's report names the rewrite as the cast one
    does (the fact is the node's ``fx16.stabilized``, which the archive keeps)."""
    x, keep = _inputs()
    ep = fx16.cast_fp32_to_fp16(export(PaddedAttention().eval(), x, keep))
    torch.export.save(ep, tmp_path / "cast.pt2")
    loaded = fx16.load(tmp_path / "cast.pt2")
    stabilized = {row.node: row.stabilized for row in report_of(ep).rows if row.stabilized}
    assert stabilized and all(why.startswith(f"{RULE}: ") for why in stabilized.values())
    assert {row.node: row.stabilized for row in report_of(loaded).rows if row.stabilized} == (
        stabilized
    )


class MaskedInABranch(nn.Module):
    """The mask built in the graph, the loud scores and their sum inside a cond branch."""

    def forward(self, x, keep):
        mask = torch.zeros(x.shape).masked_fill(~keep, MIN)
        return torch.cond(
            x.amax() > -1e9,
            lambda s, m: torch.softmax(s * 40.0 + m, dim=-1),
            lambda s, m: torch.softmax(s + m, dim=-1),
            (x, mask),
        )


def test_a_sum_inside_a_branch_is_rewritten_there():
    """Calibration observes the branch's operands (the mask's sentinel crosses into
    it): the branch's sum becomes the ``where``, and the row masked whole gets equal
    weights, as in fp32 (before: the scores' own softmax)."""
    torch.manual_seed(0)
    x, keep = torch.randn(3, 4), torch.rand(3, 4) > 0.3
    keep[0] = False
    model = MaskedInABranch()
    ep = fx16.cast_fp32_to_fp16(export(model, x, keep))
    check_program(ep)
    branch = ep.graph_module.true_graph_0
    assert [n for n in branch.graph.nodes if (meta.stabilized(n) or ("",))[0] == RULE]
    (got,) = run(ep, x, keep)
    assert torch.equal(got[0].float(), torch.full((4,), 0.25))
    with torch.no_grad():
        assert max_error([model(x, keep)], [got]) < 4 * 2.0**-11


def _guards(ep) -> int:
    """The ``where`` nodes this pass made, in every graph of ``ep`` (bodies too)."""
    return sum(
        (meta.stabilized(node) or ("",))[0] == RULE
        for module in ep.graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    )


def test_a_sum_inside_a_branch_is_guarded_once_when_cast_twice():
    """The branch's sum, cast again: its ``where`` is left as it is, the branch's code too."""
    torch.manual_seed(0)
    x, keep = torch.randn(3, 4), torch.rand(3, 4) > 0.3
    keep[0] = False
    ep = fx16.cast_fp32_to_fp16(export(MaskedInABranch(), x, keep))
    branch = ep.graph_module.true_graph_0
    code = branch.code
    assert _guards(ep) == 1
    fx16.cast_fp32_to_fp16(ep)
    assert _guards(ep) == 1 and ep.graph_module.true_graph_0.code == code


def test_a_saved_and_loaded_cast_program_cast_again_keeps_one_guard_per_sum(tmp_path):
    """A cast program saved, loaded and cast again: still one ``where`` per mask sum (the
    loaded mask holds -65504, no sentinel, on the second calibration), and it computes
    as the loaded one, bit for bit."""
    x, keep = _inputs()
    ep = fx16.cast_fp32_to_fp16(export(PaddedAttention().eval(), x, keep))
    torch.export.save(ep, tmp_path / "cast.pt2")
    loaded = fx16.load(tmp_path / "cast.pt2")
    (before,) = run(loaded, x, keep)
    fx16.cast_fp32_to_fp16(loaded)
    assert _guards(loaded) == 2
    (after,) = run(loaded, x, keep)
    assert torch.equal(after, before)


@settings(max_examples=examples(12), deadline=None)
@given(
    st.sampled_from([1.0, 30.0, 300.0, 3000.0]),
    st.sampled_from([1.0, -1.0]),
    st.integers(0, 3),
    st.integers(0, 2**16),
)
def test_property_masked_scores_hold_the_oracle_and_rows_masked_whole_stay_uniform(
    loudness, sign, masked_rows, seed
):
    """Scores of every loudness and sign, some rows masked whole, others in part: the
    cast holds the float oracle's bound against fp32 (no nan fp32 lacks), a row masked
    whole is 1/n as in fp32, and the fp32 program's rewrite changes no bit."""
    generator = torch.Generator().manual_seed(seed)
    x = sign * loudness * torch.rand(4, 6, generator=generator)
    keep = torch.rand(4, 6, generator=generator) > 0.4
    keep[:, 0] = True
    keep[:masked_rows] = False
    model = PartlyMasked()
    original = export(model, x, keep)
    ep = fx16.cast_fp32_to_fp16(export(model, x, keep))
    check_program(ep)
    check_outputs(original, ep, (x, keep))
    (got,) = run(ep, x, keep)
    assert torch.equal(
        got[:masked_rows].float(), torch.full((masked_rows, 6), 1 / 6).half().float()
    )
    rewritten = export(model, x, keep)
    run_passes([CalibrationAnalysis(rewritten), SentinelSumsPass()], rewritten.graph_module)
    rewritten.graph_module.recompile()
    with torch.no_grad():
        assert torch.equal(rewritten.module()(x, keep), model(x, keep))


class PartlyMasked(nn.Module):
    """softmax(scores + mask), the mask built from a keep flag as models build it."""

    def forward(self, x, keep):
        return torch.softmax(x + torch.zeros(x.shape).masked_fill(~keep, MIN), dim=-1)
