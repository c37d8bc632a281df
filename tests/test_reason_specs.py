"""Each Reason declares once how the stages treat it (``fx16.decisions.REASON_SPECS``);
the sets the planner, the verdict check and the range fallback read derive from there."""

import importlib.util
from pathlib import Path

import pytest
import torch

from fx16 import decisions
from fx16.analysis.fp32_rules import Fp32RulesAnalysis
from fx16.analysis.verdict_check import _CHECKED_REASONS
from fx16.decisions import FAMILIES, REASON_SPECS, Reason, ReasonSpec, reasons
from fx16.passes.range_fallback import RANGE_REASONS
from fx16.plan.view import DOWNCASTABLE

ROOT = Path(__file__).resolve().parents[1]


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


def _generated_pages():
    spec = importlib.util.spec_from_file_location(
        "generated_pages", ROOT / "docs/hooks/generated_pages.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_safety_rule_states_a_cause_for_the_tables():
    """A rule whose reason has no cause would have no row in the tables users read."""
    table = _generated_pages().fp32_table()
    for rule in Fp32RulesAnalysis.standard(torch.float16, 65504 / 2).rules:
        assert REASON_SPECS[rule.reason].cause, rule.reason.name
        assert f"`{rule.reason.name.lower()}`" in table


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/guide/what-is-cast.md"])
def test_each_what_stays_fp32_table_is_written_from_the_specs(page):
    """The tables users read are the specs' (rewrite them with
    ``python docs/hooks/generated_pages.py``): a cause changed or a rule added in the
    code and not in the pages fails here."""
    pages = _generated_pages()
    text = (ROOT / page).read_text()
    assert pages.with_table(text) == text, (
        f"{page} is out of date: python docs/hooks/generated_pages.py"
    )


def test_the_reports_integer_groupings_come_from_the_specs():
    from fx16.report.rows import NEVER_INT16_CANDIDATES

    never = reasons(never_int16=True)
    assert never == {Reason.NOT_USER_REACHABLE, Reason.NOT_CASTABLE, Reason.UNSAFE_INDEX}
    assert {reason.name.lower() for reason in never} < NEVER_INT16_CANDIDATES


def test_a_flag_no_spec_has_is_refused_by_name():
    with pytest.raises(TypeError, match="downcastible"):
        reasons(downcastible=True)
