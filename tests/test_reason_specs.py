"""Each Reason declares once how the stages treat it (``fx16.decisions.REASON_SPECS``);
the sets the planner, the verdict check and the range fallback read derive from there."""

from pathlib import Path

import pytest
import torch

from fx16 import decisions
from fx16.analysis.fp32_rules import Fp32RulesAnalysis
from fx16.analysis.verdict_check import _CHECKED_REASONS
from fx16.decisions import FAMILIES, REASON_SPECS, Reason, ReasonSpec, reasons
from fx16.passes.range_fallback import RANGE_REASONS
from fx16.plan.view import DOWNCASTABLE


def test_every_reason_is_classified():
    assert set(REASON_SPECS) == set(Reason)
    assert {spec.family for spec in REASON_SPECS.values()} <= {*FAMILIES, "integer"}


def test_a_reason_without_a_spec_is_refused_at_import(monkeypatch):
    monkeypatch.delitem(REASON_SPECS, Reason.ROUTER)
    with pytest.raises(AssertionError, match="ROUTER"):
        decisions._check_specs()
    monkeypatch.setitem(REASON_SPECS, Reason.ROUTER, ReasonSpec("precisoin"))
    with pytest.raises(AssertionError, match="of no known family: \\['ROUTER'\\]"):
        decisions._check_specs()


def test_the_sets_the_stages_read_are_derived_from_the_specs():
    assert DOWNCASTABLE == reasons(downcastable=True)
    assert _CHECKED_REASONS == reasons(checked=True)
    assert RANGE_REASONS == reasons(family="range")
    # the figures the specs replaced, as the hand-written sets had them
    assert _CHECKED_REASONS == {
        Reason.ILL_CONDITIONED,
        Reason.ACTIVATION_OVERFLOW,
        Reason.EXPLICIT_FP32,
    }
    assert Reason.FORCED in DOWNCASTABLE and Reason.ACTIVATION_OVERFLOW not in DOWNCASTABLE


def test_every_safety_rule_keeps_fp32_for_a_cause_not_a_fit():
    for rule in Fp32RulesAnalysis.standard(torch.float16, 65504 / 2).rules:
        assert REASON_SPECS[rule.reason].family not in ("fits", "integer"), type(rule).__name__


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/guide/what-is-cast.md"])
def test_every_safety_rule_has_a_row_in_each_what_stays_fp32_table(page):
    """A rule added without its row in the tables users read fails here, not silently."""
    text = (Path(__file__).resolve().parents[1] / page).read_text()
    missing = [
        rule.reason.name.lower()
        for rule in Fp32RulesAnalysis.standard(torch.float16, 65504 / 2).rules
        if f"`{rule.reason.name.lower()}`" not in text
    ]
    assert not missing, f"{page} has no row for {missing}"
