"""The pipeline by stage name (``fx16.stages.Fp16Stages``): callers look a pass up by its
stage or type, never by its position."""

import pytest
import torch

import fx16
from fx16.analysis import CalibrationAnalysis, ExplicitFp32Analysis, Fp32RulesAnalysis
from fx16.passes import (
    CleanupCastsPass,
    ConvertUserInputsPass,
    InsertFP16CastsPass,
    RangeFallbackPass,
    RecordStatsPass,
    ScalarsAsConstantsPass,
)
from fx16.pipelines import fp16_stages
from fx16.policy.options import Fp16Options
from fx16.stages import Fp16Stages
from helpers import export
from models import MLP


@pytest.fixture
def ep():
    torch.manual_seed(0)
    return export(MLP(), torch.randn(4, 8))


def test_each_stage_holds_the_passes_its_name_says(ep):
    stages = fp16_stages(ep, Fp16Options(range_fallback="bf16"))
    assert isinstance(stages.prepare[0], RecordStatsPass)
    assert isinstance(stages.calibrate[0], CalibrationAnalysis)
    assert isinstance(stages.analyze[-1], ExplicitFp32Analysis)
    assert isinstance(stages.decide[0], Fp32RulesAnalysis)
    assert isinstance(stages.convert[-1], ConvertUserInputsPass)
    assert isinstance(stages.insert[0], InsertFP16CastsPass)
    assert any(isinstance(stage, RangeFallbackPass) for stage in stages.insert)
    assert [type(stage) for stage in stages.cleanup] == [CleanupCastsPass, ScalarsAsConstantsPass]


def test_the_stages_in_order_are_the_pipeline(ep):
    stages = fp16_stages(ep, Fp16Options())
    order = [type(stage) for stage in stages.passes()]
    assert order == [type(stage) for stage in fx16.fp16_passes(ep)]
    assert stages.passes() == stages.before_decisions + stages.from_decisions
    assert Fp16Stages.names() == (
        "prepare",
        "calibrate",
        "analyze",
        "decide",
        "convert",
        "insert",
        "cleanup",
    )


def test_find_names_the_stages_when_a_pass_is_missing(ep):
    stages = fp16_stages(ep, Fp16Options())
    assert isinstance(stages.find(InsertFP16CastsPass), InsertFP16CastsPass)
    with pytest.raises(LookupError, match="no RangeFallbackPass among the stages prepare"):
        stages.find(RangeFallbackPass)


def test_a_policy_that_changes_nothing_has_empty_stages(ep):
    assert fp16_stages(ep, Fp16Options(policy="always_fp32")).passes() == []
