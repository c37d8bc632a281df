"""int16_verdict: why an integer op may or may not compute in int16, from the findings of
the int16 analyses, and the ranges its reason names.

Each case is a hand-built node (``add(a, b)`` of int64 values, ``clamp(a, 0, 100)``)
with the analyses' findings set in its meta, so the verdict is checked apart from
the analyses that usually write them."""

import pytest
import torch

from fx16 import meta
from fx16.analysis.intervals import Source, ValueRange
from fx16.decisions import Reason
from fx16.plan.narrowing import int16_verdict, may_narrow

aten = torch.ops.aten
PROVEN, DECLARED, OBSERVED = Source.PROVEN, Source.DECLARED, Source.OBSERVED


def _add(result, a, b, **findings):
    """``add(a, b)`` with the given ranges (None: none recorded) and findings."""
    graph = torch.fx.Graph()
    values = []
    for name, found in (("a", a), ("b", b)):
        value = graph.placeholder(name)
        value.meta["val"] = torch.empty(4, dtype=torch.int64)
        if found is not None:
            value.meta[meta.PROVEN_RANGE] = found
        values.append(value)
    node = graph.call_function(aten.add.Tensor, tuple(values))
    node.meta["val"] = torch.empty(4, dtype=torch.int64)
    if result is not None:
        node.meta[meta.PROVEN_RANGE] = result
    node.meta.update(
        {
            meta.USER_REACHABLE: findings.get("reachable", True),
            meta.UNSAFE_INDEX: findings.get("index", False),
            meta.CASTABLE_INT16: findings.get("castable", True),
        }
    )
    return node


SMALL = ValueRange(0, 100, PROVEN)


@pytest.mark.parametrize(
    "findings, reason",
    [
        ({"reachable": False}, Reason.NOT_USER_REACHABLE),
        ({"index": True}, Reason.UNSAFE_INDEX),
        ({"castable": False}, Reason.NOT_CASTABLE),
    ],
    ids=["not_user_reachable", "unsafe_index", "not_castable"],
)
def test_a_finding_of_the_analyses_refuses_before_any_range_is_read(findings, reason):
    node = _add(SMALL, SMALL, SMALL, **findings)
    assert int16_verdict(node, "proven") == (reason, "")
    assert not may_narrow(reason)


def test_assume_safe_narrows_without_ranges():
    assert int16_verdict(_add(None, None, None), "assume_safe") == (Reason.ASSUMED_SAFE, "")
    assert may_narrow(Reason.ASSUMED_SAFE)


def test_proven_ranges_that_fit_narrow_and_the_reason_names_each_one():
    node = _add(ValueRange(0, 200, PROVEN), SMALL, SMALL)
    reason, detail = int16_verdict(node, "proven")
    assert reason == Reason.FITS and may_narrow(reason)
    assert detail == "result [0, 200] (proven), a [0, 100] (proven), b [0, 100] (proven)"


def test_a_range_only_observed_narrows_only_in_observed_mode():
    """In "proven" mode a range seen on the calibration inputs is as good as none: the
    op keeps its width, and the reason says which values are unknown and what was seen."""
    seen = ValueRange(0, 200, OBSERVED)
    node = _add(seen, SMALL, SMALL)
    assert int16_verdict(node, "proven") == (
        Reason.RANGE_UNKNOWN,
        "unknown: result; result [0, 200] (observed), a [0, 100] (proven), b [0, 100] (proven)",
    )
    assert int16_verdict(node, "observed")[0] == Reason.FITS
    declared = _add(ValueRange(0, 200, DECLARED), SMALL, SMALL)
    assert int16_verdict(declared, "proven")[0] == Reason.FITS


def test_an_unknown_range_refuses_and_is_named_alone_when_nothing_is_known():
    assert int16_verdict(_add(None, None, SMALL), "proven") == (
        Reason.RANGE_UNKNOWN,
        "unknown: result, a; b [0, 100] (proven)",
    )
    assert int16_verdict(_add(None, None, None), "proven") == (
        Reason.RANGE_UNKNOWN,
        "unknown: result, a, b",
    )


@pytest.mark.parametrize("high", [32767, 32768])
def test_the_int16_boundary(high):
    node = _add(ValueRange(0, high, PROVEN), SMALL, SMALL)
    reason, detail = int16_verdict(node, "proven")
    assert reason == (Reason.FITS if high == 32767 else Reason.RANGE_EXCEEDS)
    assert detail.startswith(f"result [0, {high}] (proven)")


def test_an_integer_scalar_is_a_range_of_its_own():
    """``clamp(a, 0, 40000)``: the bound 40000 is named, and does not fit."""
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    a.meta["val"] = torch.empty(4, dtype=torch.int64)
    a.meta[meta.PROVEN_RANGE] = SMALL
    node = graph.call_function(aten.clamp.default, (a, 0, 40000))
    node.meta["val"] = torch.empty(4, dtype=torch.int64)
    node.meta.update(
        {
            meta.PROVEN_RANGE: SMALL,
            meta.USER_REACHABLE: True,
            meta.CASTABLE_INT16: True,
        }
    )
    assert int16_verdict(node, "proven") == (
        Reason.RANGE_EXCEEDS,
        "result [0, 100] (proven), a [0, 100] (proven), 0 [0, 0] (proven), "
        "40000 [40000, 40000] (proven)",
    )


def test_an_add_of_a_python_number_stays_wide():
    """``add(a, 5)``: the Core AI converter cannot run it in int16."""
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    a.meta["val"] = torch.empty(4, dtype=torch.int64)
    node = graph.call_function(aten.add.Tensor, (a, 5))
    node.meta["val"] = torch.empty(4, dtype=torch.int64)
    node.meta.update({meta.USER_REACHABLE: True, meta.CASTABLE_INT16: True})
    assert int16_verdict(node, "proven") == (Reason.SCALAR_OPERAND, "")
