"""ExplicitFp32Analysis: the model's own fp32 regions are kept only on evidence.

Each kind of evidence (overflow, underflow, ill-conditioning, a proven range, no
observation at all) is checked on the verdict alone, then against fp64: the kept
island is what keeps the cast accurate, and without evidence the island is cast to
fp16 at no cost in accuracy.
"""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from fx16.analysis import (
    CalibrationAnalysis,
    ConditioningAnalysis,
    ExplicitFp32Analysis,
    ValueRangeAnalysis,
)
from fx16.analysis.explicit_fp32 import island_verdict, islands
from fx16.analysis.fp32_rules import ObservedBelowRangeRule, UnderflowRule
from fx16.decisions import PRECISION, Reason
from fx16.errors import InvalidOptionError
from fx16.meta import stabilized
from fx16.pipelines import run_passes, without_rules
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.report.rows import decision_rows
from helpers import check_program, export, fp64_reference, max_error, run
from models import RMSNormMLP

aten = torch.ops.aten


def _analyse(ep, explicit_fp32="calibrated", calibration=None, input_ranges=None):
    """The verdicts, by opening node name, after the analyses the verdicts read."""
    program = Program(ep)
    policy = PrecisionPolicy.custom(explicit_fp32=explicit_fp32)
    CalibrationAnalysis(program, calibration)(ep.graph_module)
    ValueRangeAnalysis(program, input_ranges)(ep.graph_module)
    ConditioningAnalysis(program, policy)(ep.graph_module)
    result = ExplicitFp32Analysis(program, policy)(ep.graph_module)
    assert not result.modified
    return {island.opening: island for island in islands(ep.graph_module)}


def _only_verdict(ep, **options):
    (verdict,) = _analyse(ep, **options).values()
    return verdict


def _rmsnorm(scale, decompose=False):
    torch.manual_seed(0)
    x, model = torch.randn(3, 16) * scale, RMSNormMLP()
    return model, x, export(model, x, decompose=decompose)


def test_an_island_whose_values_fit_is_retargeted_with_the_largest_value_named():
    _, _, ep = _rmsnorm(1.0)
    verdict = _only_verdict(ep)
    assert not verdict.keep and verdict.dtype == torch.float16
    assert "fit 16-bit on the calibration inputs" in verdict.why
    assert {"pow_1", "mean", "add", "rsqrt", "mul"} <= verdict.members


def test_squares_beyond_fp16_keep_the_island():
    _, _, ep = _rmsnorm(300.0)
    verdict = _only_verdict(ep)
    assert verdict.keep and verdict.dtype == torch.float32
    assert verdict.why.startswith("pow_1 reaches") and "beyond 3.275e+04" in verdict.why


def test_the_margin_counts():
    """Squares up to ~4.8e4 fit fp16, but not with the default margin of 2."""
    _, _, ep = _rmsnorm(95.0)
    verdict = _only_verdict(ep)
    observed = max(n.meta.get(CalibrationAnalysis.META_KEY, 0) for n in ep.graph_module.graph.nodes)
    assert 65504 / 2 < observed < 65504
    assert verdict.keep


def test_tiny_values_keep_the_island_and_retargeted_the_underflow_rule_keeps_its_rsqrt():
    """|x| ~ 1e-3 squares to ~1e-6, in fp16's subnormal range: 3% spacing. Without the
    rewrite (``stabilize=False``) the island stays fp32; retargeted, the rsqrt the
    variance reaches (and the mean and squares before it) stays fp32 by the underflow
    rule; without either, the error grows."""
    model, x, ep = _rmsnorm(1e-3)
    verdict = _only_verdict(copy.deepcopy(ep))
    assert verdict.keep and "subnormal" in verdict.why
    kept, retargeted, unprotected = copy.deepcopy(ep), copy.deepcopy(ep), copy.deepcopy(ep)
    fx16.cast_fp32_to_fp16(kept, stabilize=False)
    fx16.cast_fp32_to_fp16(retargeted, explicit_fp32="retarget", stabilize=False)
    rules = {row.node: row.rule for row in fx16.report.report_of(retargeted).rows}
    assert rules["rsqrt"] == rules["mean"] == rules["pow_1"] == "underflow"
    passes = fx16.fp16_passes(unprotected, explicit_fp32="retarget", stabilize=False)
    # without the underflow rule nor the one for values below the range (the squares)
    run_passes(
        without_rules(passes, UnderflowRule, ObservedBelowRangeRule), unprotected.graph_module
    )
    reference = fp64_reference(model, x)
    for cast in (kept, retargeted):
        assert max_error(reference, run(cast, x)) < 1e-3
        assert max_error(reference, run(unprotected, x)) > 5 * max_error(reference, run(cast, x))


class SineIsland(nn.Module):
    """The model computes sin in fp32 itself: 16-bit rounding of 100 x moves it by ~0.05."""

    def forward(self, x):
        return (x.to(torch.float32) * 100).sin().to(torch.float32) + x


def test_an_ill_conditioned_op_keeps_the_island():
    ep = export(SineIsland(), torch.randn(2, 8))
    verdict = _analyse(ep)["to"]
    assert verdict.keep and "ill-conditioned" in verdict.why


class SquaredTimestep(nn.Module):
    """A float timestep made from an integer, squared in the model's own fp32 region."""

    def forward(self, t, x):
        h = t.float().to(torch.float32)
        return x * ((h * h).mean(-1, keepdim=True) + 1).rsqrt()


def test_a_proven_range_beyond_fp16_keeps_the_island_whatever_calibration_saw():
    args = (torch.tensor([[3, 5]]), torch.randn(1, 2))
    unbounded = export(SquaredTimestep(), *args)
    assert not _analyse(unbounded)["to_1"].keep  # the example's t = 5 fits
    bounded = export(SquaredTimestep(), *args)
    verdict = _analyse(bounded, input_ranges={"t": (0, 999)})["to_1"]
    assert verdict.keep and "(proven)" in verdict.why


def test_an_island_no_calibration_input_reached_is_kept():
    _, _, ep = _rmsnorm(1.0)
    verdict = _only_verdict(ep, calibration=[])
    assert verdict.keep and verdict.why.startswith("no calibration input reached")


@pytest.mark.parametrize("setting, keep", [("keep", True), ("retarget", False)])
def test_the_policy_can_decide_every_island(setting, keep):
    _, _, ep = _rmsnorm(300.0 if not keep else 1.0)
    verdict = _only_verdict(ep, explicit_fp32=setting)
    assert verdict.keep is keep
    assert verdict.why == f"the policy's explicit_fp32={setting!r}"


class NotARegion(nn.Module):
    """GPT-2's ``attn_weights.type(value.dtype)``: fp32 at export, nothing sensitive after."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x.to(torch.float32).relu())


def test_a_cast_with_no_sensitive_op_after_it_opens_no_island():
    ep = export(NotARegion(), torch.randn(2, 4))
    assert _analyse(ep, explicit_fp32="keep") == {}


class SoftmaxInFp32(nn.Module):
    def forward(self, x):
        return (x * 1e3).softmax(-1, dtype=torch.float32) @ x.transpose(0, 1)


def test_an_op_given_dtype_float32_is_decided_like_a_cast():
    ep = export(SoftmaxInFp32(), torch.randn(4, 4))
    verdicts = _analyse(ep)
    assert list(verdicts) == ["softmax"]
    assert verdicts["softmax"].keep is False and "softmax" in verdicts["softmax"].members


def test_analysis_meta_on_the_opening_node_and_its_graph():
    _, _, ep = _rmsnorm(1.0)
    _analyse(ep)
    opening = next(n for n in ep.graph_module.graph.nodes if n.target == aten.to.dtype)
    assert island_verdict(opening) == islands(ep.graph_module)[0]
    assert all(island_verdict(n) is None for n in ep.graph_module.graph.nodes if n is not opening)


class NormWithResidual(nn.Module):
    """A pre-norm block: the residual add reads the 16-bit x, not the norm's fp32 copy."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNormMLP(eps=1e-4).norm  # an eps in fp16's normal range

    def forward(self, x):
        return self.norm(x) + x


@pytest.mark.parametrize("decompose", [False, True])
def test_kept_island_ends_where_the_model_casts_back(decompose):
    """With the island kept (not rewritten), its ops run fp32 with no cast back inside;
    the residual add outside it stays 16-bit (after decomposition too, where only the
    checks are left)."""
    torch.manual_seed(0)
    x = torch.randn(3, 16) * 300
    model = NormWithResidual()
    ep = export(model, x, decompose=decompose)
    fx16.cast_fp32_to_fp16(ep, explicit_fp32="calibrated", stabilize=False)
    check_program(ep)
    nodes = {n.name: n for n in ep.graph_module.graph.nodes}
    for name in ("pow_1", "mean", "rsqrt"):
        assert nodes[name].meta[PRECISION].reason == Reason.EXPLICIT_FP32
        assert "reaches" in nodes[name].meta[PRECISION].detail
    (residual,) = ep.graph_module.graph.output_node().args[0]
    assert residual.target == aten.add.Tensor
    assert residual.meta["val"].dtype == torch.float16
    assert all(arg.meta["val"].dtype == torch.float16 for arg in residual.args)
    assert max_error(fp64_reference(model, x), run(ep, x)) < 1e-2


@pytest.mark.parametrize("decompose", [False, True])
def test_every_verdict_is_a_row_of_the_report(decompose):
    """Retargeted casts are removed by cleanup, and decomposed ones are only checks: the
    report still lists each opening with its rule and evidence."""
    _, _, ep = _rmsnorm(1.0, decompose=decompose)
    fx16.cast_fp32_to_fp16(ep, explicit_fp32="calibrated")
    (row,) = [r for r in decision_rows(ep) if r.rule == "explicit_fp32_retargeted"]
    assert row.dtype == "float16" and row.narrowed and "largest" in row.detail


def test_unknown_setting_is_an_invalid_option():
    with pytest.raises(InvalidOptionError, match="explicit_fp32 must be one of"):
        PrecisionPolicy.custom(explicit_fp32="sometimes")
    _, _, ep = _rmsnorm(1.0)
    before = copy.deepcopy(ep.graph_module.code)
    with pytest.raises(InvalidOptionError):
        fx16.cast_fp32_to_fp16(ep, explicit_fp32=True)
    assert ep.graph_module.code == before


@pytest.mark.parametrize(
    "preset, setting",
    [
        ("default", "keep"),
        ("auto_mixed", "keep"),
        ("auto_mixed_bf16", "keep"),
        ("always_fp16", "retarget"),
        ("auto_mixed_conservative", "keep"),
        ("autocast", "keep"),
    ],
)
def test_presets(preset, setting):
    assert PrecisionPolicy.named(preset).explicit_fp32 == setting


@settings(max_examples=18, deadline=None)
@given(exponent=st.floats(min_value=-4.0, max_value=4.0), decompose=st.booleans())
def test_default_cast_of_an_rmsnorm_is_accurate_at_every_scale(exponent, decompose):
    """From |x| ~ 1e-4 (squares below fp16's normal range) to 1e4 (squares beyond its
    maximum): the island is kept exactly where retargeting it would cost accuracy."""
    model, x, ep = _rmsnorm(10.0**exponent, decompose=decompose)
    fx16.cast_fp32_to_fp16(ep)
    (got,) = run(ep, x)
    assert torch.isfinite(got).all()
    assert max_error(fp64_reference(model, x), [got]) < 2e-3


def test_the_default_keeps_the_model_fp32_regions_as_half_does():
    """A T5 v1.1 encoder inside fp16's range: retargeting its RMSNorms' fp32 regions
    (``explicit_fp32="calibrated"``, the default before) rounds each row's mean of
    squares and rsqrt in 16-bit, and measured 1.5x ``.half()``'s error with ATen's AVX-512
    kernels (0.9x with its default ones). The default keeps them as ``.half()`` does, with
    no stable rewrite inside, and is within 20% of ``.half()``'s error on every kernel
    path (means over six token draws, each against fp64; the GELU's rewrite moves single
    draws either way)."""
    from benchmarks import zoo

    torch.manual_seed(0)
    model = zoo.massive_t5_encoder(2e3).eval()

    def ids(seed):
        return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))

    ep = fx16.cast_fp32_to_fp16(torch.export.export(model, (ids(1),)))
    verdicts = [v for m in ep.graph_module.modules() for v in islands(m)]
    assert verdicts and all(v.keep for v in verdicts)
    rewritten = [stabilized(n) for n in ep.graph_module.graph.nodes if stabilized(n)]
    assert "rms_norm_scaling" not in {rule for rule, _ in rewritten}
    half, wide = copy.deepcopy(model).half(), copy.deepcopy(model).double()
    errors = {"fx16": 0.0, ".half()": 0.0}
    with torch.no_grad():
        for seed in range(2, 8):
            want = [wide(ids(seed))]
            errors["fx16"] += max_error(want, run(ep, ids(seed)))
            errors[".half()"] += max_error(want, [half(ids(seed))])
    assert errors["fx16"] <= 1.2 * errors[".half()"], errors


class Bf16RoundTripThenFp32Norm(nn.Module):
    """The model's own bf16 round trip, then its own fp32 RMSNorm of the result: after
    decomposition one cast, bf16 -> fp32, is both the way back and the region's
    opening."""

    def forward(self, x):
        h = x.to(torch.bfloat16).to(x.dtype)
        g = h.to(torch.float32)
        return h, (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


@pytest.mark.parametrize("decompose", [True, False])
def test_a_region_opened_from_the_models_own_bf16_reads_it_widened(decompose):
    """Once, the region's ops and the output read the bf16 value in the opening's
    place (as they would read an fp16 one): the norm's product mixed bf16 with fp16
    (computing fp32 where fp16 was recorded) and the program failed to run. They read
    the widened value now: the program lints, runs, and holds fp16's rounding."""
    torch.manual_seed(0)
    model, x = Bf16RoundTripThenFp32Norm().eval(), torch.randn(3, 8)
    ep = fx16.cast_fp32_to_fp16(export(model, x, decompose=decompose))
    check_program(ep)
    outputs = run(ep, x)
    assert [out.dtype for out in outputs] != [torch.bfloat16] * 2
    assert max_error(fp64_reference(model, x), outputs) < 4 * 2.0**-8  # bf16's rounding
