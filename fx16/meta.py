"""Every ``node.meta`` and ``graph_module.meta`` key fx16 uses, and typed readers for them.

The analyses publish their facts in meta; every other module reads them here, by
function, never by key: a key is written by exactly one analysis, and renaming or
reshaping it touches this module and that analysis only. Torch-free: importing it
loads no analysis.
"""

import math
from typing import Any

# ---- node.meta: what the analyses found ----------------------------------------------
OBSERVED_MAX_ABS = "fx16.observed_range"  # CalibrationAnalysis: largest |value| seen
OBSERVED_INTERVAL = "fx16.observed_interval"  # CalibrationAnalysis: (smallest, largest)
OBSERVED_SENTINEL = "fx16.observed_sentinel"  # CalibrationAnalysis: holds a -1e38 mask value
OBSERVED_CENTERING = "fx16.observed_centering"  # CalibrationAnalysis: a norm's cancellation
OBSERVED_SMALLEST = "fx16.observed_smallest"  # CalibrationAnalysis: smallest nonzero |value|
OBSERVED_INT_RANGE = "fx16.observed_int_range"  # CalibrationAnalysis: an integer's range
PROVEN_RANGE = "fx16.value_range"  # ValueRangeAnalysis: a ValueRange
UNSAFE_INDEX = "fx16.unsafe_index"  # UnsafeIndexAnalysis: flows into an index
USER_REACHABLE = "fx16.user_reachable"  # UserReachabilityAnalysis
CASTABLE_INT16 = "fx16.castable_int16"  # CastableInt16Analysis
ILL_CONDITIONED = "fx16.ill_conditioned"  # ConditioningAnalysis: why, where it keeps fp32
CONDITIONING = "fx16.conditioning"  # ConditioningAnalysis: the finding (kappa, ...)
UNDERFLOW = "fx16.underflow"  # UnderflowAnalysis: why
ROUTER = "fx16.router"  # RoutingAnalysis: why
ISLAND = "fx16.explicit_fp32"  # ExplicitFp32Analysis: the verdict on a region's opening
FP32_RULE = "fx16.fp32_rule"  # Fp32RulesAnalysis: the Decision of the rule that fired
NOT_WORTH_FP32 = "fx16.not_worth_fp32"  # VerdictCheckAnalysis: why a verdict was refuted
PLANNED = "fx16.planned"  # the fp16 inserter: its plan for the node (fx16.plan.steps.Planned)
STABILIZED = "fx16.stabilized"  # StabilizePass: (rule name, detail) on a rewrite's result
NEGLIGIBLE = "fx16.negligible"  # StabilizePass: why flushing this value to 0 loses nothing
ROUNDING_CANCELS = "fx16.rounding_cancels"  # StabilizePass: why this value's error is harmless
BOUNDED_BELOW = "fx16.bounded_below"  # StabilizePass: why this value cannot flush to zero
SCALED = "fx16.scaled"  # StabilizePass: why this value stays in range for any input
SCALAR_ROUNDS_EXACTLY = "fx16.scalar_rounds_exactly"  # StabilizePass: why its scalar may round
SCALE_EXPONENT = "fx16.scale_exponent"  # ScaleDomainsPass: e, the value holds v * 2**e
RANGE_SCALE = "fx16.range_scale"  # ScaleDomainsPass: why it inserted this multiply
SENTINEL_FILL = "fx16.sentinel_fill"  # SentinelFillsPass: why this fill is a sentinel now

# ---- graph_module.meta ---------------------------------------------------------------
CALIBRATION_OUTPUTS = "fx16.calibration_outputs"  # CalibrationAnalysis: fp32 reference
CALIBRATION_STATUS = "fx16.calibration"  # CalibrationAnalysis: how it went
ISLANDS = ISLAND  # ExplicitFp32Analysis: every verdict of one graph, a list
FP32_RULES_RAN = "fx16.fp32_rules"  # Fp32RulesAnalysis: the rules that ran
VERDICT_CHECKS = "fx16.verdict_checks"  # VerdictCheckAnalysis: what each check measured
SCALE_PLAN = "fx16.scale_plan"  # ScaleDomainsAnalysis: the plan ScaleDomainsPass applies
SCALE_DOMAINS = "fx16.scale_domains"  # ScaleDomainsAnalysis: a Domain per scale domain
# CalibrationAnalysis (fx16.analysis.size_growth): on a node, (factor, lengths, what was
# observed) where it is judged at the dynamic sizes' bounds; on the graph, the lengths
# every decision holds to
SIZE_GROWTH = "fx16.size_growth"
DYNAMIC_LENGTHS = "fx16.dynamic_lengths"
# in graph_module.meta["custom"], which torch.export.save keeps: a cast's report (provenance,
# margin, the placeholders' decisions; fx16.report.saved)
SAVED_REPORT = "fx16_report"


def cast_by_fx16(graph_module: Any, decision_key: str) -> bool:
    """fx16 cast this program before: a node carries its decision (``decision_key``), or
    the graph module the report a saved cast keeps."""
    if SAVED_REPORT in (graph_module.meta.get("custom") or {}):
        return True
    return any(decision_key in node.meta for node in graph_module.graph.nodes)


def observed_max_abs(node: Any) -> float | None:
    """The largest magnitude calibration saw the node hold (None: not observed)."""
    return _meta(node).get(OBSERVED_MAX_ABS)


def observed_said(node: Any) -> str:
    """The largest magnitude a rule judged ``node`` by, as its detail says it: what
    calibration observed, or that times the growth to a dynamic size's bound
    (``fx16.analysis.size_growth``), with both."""
    seen = observed_max_abs(node)
    grown = _meta(node).get(SIZE_GROWTH)
    if seen is None or not grown:
        return f"observed {seen:.4g}" if seen is not None else "not observed"
    _, lengths, observed = grown
    return f"{seen:.4g} judged at {lengths} (observed {observed:.4g})"


def bounded_below(node: Any) -> str | None:
    """Why a stable rewrite's value cannot flush to zero (None: nothing said)."""
    return _meta(node).get(BOUNDED_BELOW)


def scaled(node: Any) -> str | None:
    """Why a stable rewrite's value stays in 16-bit's range for any input (None: nothing said)."""
    return _meta(node).get(SCALED)


def observed_interval(node: Any) -> tuple[float, float] | None:
    """The smallest and largest value calibration saw (None: not observed)."""
    return _meta(node).get(OBSERVED_INTERVAL)


def was_observed(node: Any) -> bool:
    return OBSERVED_MAX_ABS in _meta(node)


def holds_sentinel(node: Any) -> bool:
    """Calibration saw the node hold a masking sentinel (-1e38, finfo.min)."""
    return bool(_meta(node).get(OBSERVED_SENTINEL))


def overflows(node: Any, limit: float, proven=None) -> bool:
    """The node holds a magnitude above ``limit`` (the 16-bit maximum over the overflow
    margin): the one overflow test every rule and pass applies. The magnitude is
    ``largest_magnitude``'s: calibration's, or ``proven``'s where that range is finite."""
    return (largest_magnitude(node, proven)[0] or 0.0) > limit


def carried_by_cast(node: Any, limit: float, smallest_normal: float) -> bool:
    """A value kept fp32 that a cast to 16-bit carries whole, as calibration saw it:
    within ``limit`` (the 16-bit maximum over the overflow margin), not wholly below
    ``smallest_normal`` (it would reach its reader as subnormals), and with no
    infinity-like sentinel (cast down, -1e38 is -inf, not the maximum fx16 saturates
    it to)."""
    seen = observed_max_abs(node)
    below = bool(seen) and seen < smallest_normal
    return not overflows(node, limit) and not below and not holds_sentinel(node)


def largest_magnitude(node: Any, proven=None) -> tuple[float | None, str]:
    """The largest |value| of ``node`` and where it comes from: "proven" when
    ``proven`` (a range with ``low`` and ``high``) is finite, else "observed" by
    calibration (None: not observed)."""
    if proven is not None and math.isfinite(proven.low) and math.isfinite(proven.high):
        return max(abs(proven.low), abs(proven.high)), "proven"
    return _meta(node).get(OBSERVED_MAX_ABS), "observed"


def proven_range(node: Any):
    """The ValueRange the integer range analysis proved (None: unknown)."""
    return _meta(node).get(PROVEN_RANGE)


def observed_int_range(node: Any) -> tuple[int, int] | None:
    """The smallest and largest integer calibration saw the node hold (None: not seen)."""
    return _meta(node).get(OBSERVED_INT_RANGE)


def calibration_outputs(graph_module: Any) -> list | None:
    """The fp32 outputs of each calibration call, kept as the reference (None: none)."""
    return graph_module.meta.get(CALIBRATION_OUTPUTS)


def flows_into_index(node: Any) -> bool:
    return bool(_meta(node).get(UNSAFE_INDEX))


def user_reachable(node: Any) -> bool:
    return bool(_meta(node).get(USER_REACHABLE))


def castable_int16(node: Any) -> bool:
    return bool(_meta(node).get(CASTABLE_INT16))


def ill_conditioned(node: Any) -> str | None:
    """Why the conditioning analysis keeps the node in fp32 (None: it does not)."""
    return _meta(node).get(ILL_CONDITIONED)


def conditioning_finding(node: Any):
    """What the conditioning analysis measured on the node (its condition number)."""
    return _meta(node).get(CONDITIONING)


def underflows(node: Any) -> str | None:
    """Why the underflow analysis keeps the node in fp32 (None: it does not)."""
    return _meta(node).get(UNDERFLOW)


def routes(node: Any) -> str | None:
    """Why the routing analysis keeps the node in fp32 (None: it does not)."""
    return _meta(node).get(ROUTER)


def fp32_rule(node: Any):
    """The Decision of the safety rule that keeps the node in fp32 (None: none does)."""
    return _meta(node).get(FP32_RULE)


def refuted(node: Any) -> str | None:
    """Why the verdict check found fp32 not worth its cost here (None: not refuted)."""
    return _meta(node).get(NOT_WORTH_FP32)


def island_verdict(node: Any):
    """The ExplicitFp32Analysis verdict on a node that opens a region (None: none)."""
    return _meta(node).get(ISLAND)


def keeps_island(node: Any) -> bool:
    """``node`` opens a region of the model's own that ExplicitFp32Analysis keeps fp32."""
    verdict = island_verdict(node)
    return verdict is not None and verdict.keep


def scale_exponent(node: Any) -> int:
    """e where the value is carried at 2**e (ScaleDomainsPass); 0 for one that is not."""
    return _meta(node).get(SCALE_EXPONENT, 0)


def range_scaled(node: Any) -> str | None:
    """Why ScaleDomainsPass inserted this power-of-two multiply ("x 2**-5: starts a
    scale domain"); None for any other node."""
    return _meta(node).get(RANGE_SCALE)


def sentinel_fill(node: Any) -> str | None:
    """Why SentinelFillsPass carries this op's fill as an infinity-like sentinel (a
    ``masked_fill(~mask, -1e9)`` far beyond the scores); None for any other node."""
    return _meta(node).get(SENTINEL_FILL)


def stabilized(node: Any) -> tuple[str, str] | None:
    """(rule name, detail) where StabilizePass rewrote a pattern into this node's value."""
    return _meta(node).get(STABILIZED)


def negligible(node: Any) -> str | None:
    """Why flushing this value to zero in 16-bit changes nothing that matters (a value
    StabilizePass made, added to a far larger one); None for any other value."""
    return _meta(node).get(NEGLIGIBLE)


def scalar_rounds_exactly(node: Any) -> str | None:
    """Why this op gives eager's result, bit for bit, with its Python number rounded to
    the 16-bit type (a product of a power of two whose subnormal values square to
    zero), so ``ScalarsAsConstantsPass`` may store it so; None for any other op."""
    return _meta(node).get(SCALAR_ROUNDS_EXACTLY)


def rounding_cancels(node: Any) -> str | None:
    """Why any rounding of this value cancels out of the result (a scale that the
    expression divides back out: any positive value would do); None for other values."""
    return _meta(node).get(ROUNDING_CANCELS)


def planned(node: Any):
    """What the fp16 inserter's plan said of the node (``fx16.plan.steps.Planned``: the
    precedence rule that chose, the inputs it reads narrowed, its cast-back or why it
    has none); None for a node no plan decided."""
    return _meta(node).get(PLANNED)


def _meta(node: Any) -> dict:
    try:
        meta = node.meta
    except AttributeError:  # a constant argument, not a node
        return {}
    return meta if type(meta) is dict else {}
