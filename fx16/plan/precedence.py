"""Which precision an op gets, and why: one ordered rule list per node kind, as data.

The fp16 cast planner (``fx16.plan.planner``) asks ``choose`` about every node before
anything is rewritten. ``choose`` reads the node, the dtypes and decisions its inputs
will carry (``View.read``: from the plan so far, or from the graph as it is), the
safety rules' verdicts (``meta["fx16.fp32_rule"]``), the island verdicts
(``meta["fx16.explicit_fp32"]``), calibration and the policy, and changes nothing:
it returns a ``Choice`` (an action, the reason, the detail that names the evidence
or the input responsible, and the rule that chose). The planner turns it into a
``Step``; applying that is ``fx16.passes.fp16_rewrite``'s job.

Each list is tried in order and the first rule that applies chooses, as TVM's
ALWAYS / FOLLOW / NEVER lists are data: the precedence of the reasons is the order
of the rules below, and a decision can be tested by calling ``choose`` on a node,
without a rewrite. Three kinds of node have lists: compute ops (every op that is not
a cast, a creation op, a higher-order op or bookkeeping), the model's casts to fp32,
and creation ops that make fp32 tensors (``full``, ``arange``, ``zeros_like``).
"""

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import Node

from fx16 import meta
from fx16.decisions import Decision, Reason
from fx16.ops.declarations import declares_output_dtype
from fx16.ops.kinds import is_known_op
from fx16.ops.tables import is_custom_op
from fx16.plan.view import View
from fx16.policy import Precision
from fx16.program.nodes import SIXTEEN_BIT_DTYPES, requested_dtypes, tensor_inputs

FP32 = torch.float32


class Action(enum.Enum):
    """What the inserter does with a node (see ``fx16.passes.fp16_rewrite``)."""

    LOW = "compute in 16-bit: fp32 inputs that may be narrowed are, dtype arguments follow"
    FP32 = "compute in fp32: 16-bit inputs widened, the result cast back where it fits"
    OPEN_REGION = "open the model's own fp32 region (kept by ExplicitFp32Analysis)"
    IN_REGION = "inside the model's fp32 region: fp32 as the model computes it, no casts"
    FOLLOW = "take the dtype its inputs give it"
    PROMOTE = "widen its inputs to the widest of them, then follow"
    WIDEN = "compute in fp32 as eager autocast does: 16-bit inputs widened, the model's own too"
    RETARGET = "point the model's cast at the 16-bit dtype"
    KEEP = "keep the model's cast to fp32 of an fp32 value as it is"
    LEAVE = "nothing to decide: no input was narrowed"


@dataclass(slots=True)
class Choice:
    action: Action
    reason: Reason | None = None
    detail: str = ""
    rule: str = ""  # the precedence rule that chose
    cast_back: bool = True  # for FP32: whether consumers may read a 16-bit copy


@dataclass(frozen=True)
class Rule:
    """One entry of a precedence list: ``test`` returns a Choice when it applies."""

    name: str
    test: Callable[[View], Choice | None]


def choose(rules: tuple[Rule, ...], view: View) -> Choice:
    """The choice of the first rule in ``rules`` that applies to ``view``'s node, with
    that rule's name."""
    for rule in rules:
        choice = rule.test(view)
        if choice is not None:
            choice.rule = rule.name
            return choice
    raise AssertionError(f"no precedence rule applies to {view.node.name}")  # lists end total


def _why_input(view: View, value: Node) -> str:
    read = view.read(value)
    why = f": {read.decision.reason.name.lower()}" if read.decision is not None else ""
    return f"from {read.name}{why}"


def _safety_rule(view: View) -> Choice | None:
    """A safety rule keeps the node fp32 (``meta["fx16.fp32_rule"]``): computed in
    fp32. An op with no 16-bit kernel is fp32 as a policy's op is, so its consumers read
    a 16-bit copy where the policy casts back (eager autocast's fp32 list: they follow
    the fp32 result)."""
    rule: Decision | None = meta.fp32_rule(view.node)
    if rule is None:
        return None
    cast_back = view.policy.cast_back if rule.reason is Reason.NO_LOW_KERNEL else True
    return Choice(Action.FP32, rule.reason, rule.detail, cast_back=cast_back)


def _policy_fp32(view: View) -> Choice | None:
    """The policy puts the op in fp32: computed in fp32, its consumers read a 16-bit
    copy where the policy casts back."""
    if view.precision == Precision.FP32:
        return Choice(Action.FP32, Reason.POLICY, view.entry(), cast_back=view.policy.cast_back)
    return None


def _scalar_overflow(view: View) -> Choice | None:
    """A scalar argument beyond the 16-bit range: computed in fp32."""
    value = view.overflowing_scalar()
    if value is None:
        return None
    return Choice(Action.FP32, Reason.SCALAR_OVERFLOW, f"scalar {value:g}")


# ---- compute ops -------------------------------------------------------------------


def _policy_widens_model_16bit(view: View) -> Choice | None:
    """An op the policy puts in fp32 reads a 16-bit value the model made itself, and the
    policy widens those too (eager autocast's fp32 list)."""
    if not view.policy.widen_model_16bit or view.precision != Precision.FP32:
        return None
    if any(view.read(arg).dtype in SIXTEEN_BIT_DTYPES for arg in view.float_inputs):
        return Choice(Action.WIDEN, Reason.POLICY, view.entry())
    return None


def _nothing_narrowed(view: View) -> Choice | None:
    """No input was narrowed and none is fp32: nothing to decide, left as it is; except
    an op whose declared argument sets its output dtype (a PT2E dequantize of int8
    values by a Python scale, ``fx16.ops.declarations``): its result is decided too."""
    if view.fp32_inputs or view.narrowed_input:
        return None
    if view.produces_fp32 and declares_output_dtype(view.node.target):
        return None
    if view.produces_fp32 and not view.float_inputs:
        return Choice(Action.LEAVE, Reason.NO_FLOAT_INPUT)
    return Choice(Action.LEAVE)


def _opens_region(view: View) -> Choice | None:
    """The op opens an fp32 region the model asks for (its dtype argument) and the
    region is kept: fp32 as the model computes it."""
    if meta.keeps_island(view.node) and FP32 in requested_dtypes(view.node):
        return Choice(Action.OPEN_REGION)
    return None


def _inside_region(view: View) -> Choice | None:
    """Every float input comes from a kept fp32 region of the model: fp32 inside it,
    no casts."""
    if view.fp32_inputs and all(view.island(arg) for arg in view.float_inputs):
        detail = view.read(view.fp32_inputs[0]).decision.detail
        return Choice(Action.IN_REGION, Reason.EXPLICIT_FP32, detail)
    return None


def _computed_16bit_by_the_model(view: View) -> Choice | None:
    """The model computes the op in 16-bit itself (a decomposed autocast region), and a
    safety rule, the policy or a scalar would make it fp32: it is left as the model
    computes it. Its inputs are 16-bit in the source too; widening the ones fx16 touched
    made it compute fp32 where the graph records, and may check, 16-bit."""
    if view.fp32_inputs or not view.produces_16bit:
        return None
    wants_fp32 = (
        meta.fp32_rule(view.node) is not None
        or view.precision == Precision.FP32
        or view.overflowing_scalar() is not None
    )
    return Choice(Action.LEAVE) if wants_fp32 else None


def _policy_follow(view: View) -> Choice | None:
    """The policy lets the op follow (or promote) its inputs' dtypes."""
    if view.precision in (Precision.FOLLOW, Precision.PROMOTE):
        action = Action.PROMOTE if view.precision == Precision.PROMOTE else Action.FOLLOW
        return Choice(action, Reason.POLICY_FOLLOW, view.entry())
    return None


def _fp32_input(view: View) -> Choice | None:
    """An fp32 input that may not be cast down (a safety rule's value, an overflow):
    computed in fp32."""
    kept = [arg for arg in view.fp32_inputs if not view.downcastable(arg)]
    if not kept:
        return None
    below = ", below the 16-bit normal range" if view.below_normal(kept[0]) else ""
    return Choice(Action.FP32, Reason.FP32_INPUT, _why_input(view, kept[0]) + below)


def _mixed_float_dtypes(view: View) -> Choice | None:
    """Inputs of two float dtypes where the op would compute fp32: computed in fp32,
    as the model's math has it."""
    other = view.other_float
    if not view.produces_fp32 or other is None:
        return None
    dtype = str(other.dtype).removeprefix("torch.")
    return Choice(Action.FP32, Reason.MIXED_FLOAT_DTYPES, f"{other.name} is {dtype}")


def _fits(view: View) -> Choice:
    """Nothing keeps it wide: computed in 16-bit."""
    node = view.node
    known = is_known_op(node.target) or is_custom_op(node.target)
    detail = "" if known else "an op fx16's tables do not list: computed as its inputs are"
    return Choice(Action.LOW, Reason.FITS, detail)


COMPUTE_RULES = (
    Rule("policy_widens_model_16bit", _policy_widens_model_16bit),
    Rule("no_narrowed_input", _nothing_narrowed),
    Rule("opens_model_fp32_region", _opens_region),
    Rule("inside_model_fp32_region", _inside_region),
    Rule("computed_16bit_by_the_model", _computed_16bit_by_the_model),
    Rule("safety_rule", _safety_rule),
    Rule("policy_fp32", _policy_fp32),
    Rule("policy_follow", _policy_follow),
    Rule("fp32_input", _fp32_input),
    Rule("scalar_overflow", _scalar_overflow),
    Rule("mixed_float_dtypes", _mixed_float_dtypes),
    Rule("fits", _fits),
)


# ---- the model's casts to fp32 -------------------------------------------------------


def _way_back(view: View) -> Choice | None:
    """The model's cast back to fp32 after its own fp32 region is retargeted at
    16-bit with the region (its decision is the region's: ``island_decision``)."""
    source = view.node.args[0]
    if view.read(source).dtype == FP32 and view.island(source) and view.policy.cast_back:
        return Choice(Action.RETARGET)
    return None


def _fp32_source(view: View) -> Choice | None:
    """The cast reads an fp32 value: kept as it is."""
    source = view.node.args[0]
    read = view.read(source)
    if read.dtype != FP32:
        return None
    reason = read.decision.reason if read.decision is not None else Reason.FP32_INPUT
    return Choice(Action.KEEP, reason, _why_input(view, source))


def _cast_opens_region(view: View) -> Choice | None:
    """The model's cast to fp32 of a 16-bit value opens a region that is kept: fp32
    as the model asks (the decision is the region's verdict: ``island_decision``)."""
    source_dtype = view.read(view.node.args[0]).dtype
    if source_dtype in SIXTEEN_BIT_DTYPES and meta.keeps_island(view.node):
        return Choice(Action.OPEN_REGION)
    return None


def _policy_16bit(view: View) -> Choice | None:
    """The policy puts the cast in 16-bit: it is retargeted at the 16-bit dtype (its
    decision is its region's, as for ``_way_back``)."""
    return Choice(Action.RETARGET) if view.precision == Precision.LOW else None


def _policy_keeps_cast(view: View) -> Choice:
    """Otherwise the policy keeps the model's cast to fp32."""
    return Choice(Action.FP32, Reason.POLICY, view.entry())


CAST_TO_FP32_RULES = (
    Rule("safety_rule", _safety_rule),
    Rule("way_back_from_model_fp32_region", _way_back),
    Rule("fp32_source", _fp32_source),
    Rule("opens_model_fp32_region", _cast_opens_region),
    Rule("policy_16bit", _policy_16bit),
    Rule("policy_fp32", _policy_keeps_cast),
)


# ---- creation ops --------------------------------------------------------------------


def _creation_follows(view: View) -> Choice | None:
    """The policy lets creation ops follow: a ``*_like`` of a 16-bit tensor follows
    it; otherwise fp32 as the model makes it, which a 16-bit op may read through a
    cast."""
    if view.precision not in (Precision.FOLLOW, Precision.PROMOTE):
        return None
    if any(view.read(arg).narrowed for arg in tensor_inputs(view.node)):  # *_like of 16-bit
        return Choice(Action.FOLLOW, Reason.POLICY_FOLLOW, view.entry())
    # fp32 as the model makes it; a 16-bit op may read it through a cast, as eager
    # autocast casts the fp32 tensors its lower-precision ops read
    return Choice(Action.LEAVE, Reason.POLICY_FOLLOW, view.entry())


def _creation_fits(view: View) -> Choice:
    """Nothing keeps it wide: the tensor is made in 16-bit."""
    return Choice(Action.LOW, Reason.FITS)


CREATION_RULES = (
    Rule("policy_follow", _creation_follows),
    Rule("safety_rule", _safety_rule),
    Rule("policy_fp32", _policy_fp32),
    Rule("scalar_overflow", _scalar_overflow),
    Rule("fits", _creation_fits),
)
