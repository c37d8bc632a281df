"""Where a scale domain sits in fp16's range: its exponent centred between the least
that fits its largest value and the most its folded weights allow.

The least k that fits (``2**-k`` bringing the domain's largest value inside the limit)
leaves less than 2x of headroom: inputs a few times larger than calibration's pass
fp16's largest, where the fp32 path (``scale_range=False``) may hold further. A power of
two costs nothing, so k is raised towards the middle of what the two ends allow: the
top (the limit over the largest value at ``2**-k``) and the small end (each folded
weight's largest magnitude kept at least ``SMALLEST_FOLDED``, as every fold keeps it;
an addend's, a bias or a running mean, in the normal range). A domain that folds no
state tensor has no known small end (calibration records each value's largest
magnitude, not its smallest) and keeps the least k. A raised k is kept only where the
plan it gives is no costlier: the same tensors folded, no more runtime multiplies,
every fold and scalar as far inside fp16's range as before (else a smaller raise is
tried, and the report says what stopped the larger).
"""

import math
from dataclasses import dataclass

from torch.fx import Node

from fx16.analysis.scale_exponents import propagate
from fx16.analysis.scale_plan import (
    SMALLEST_FOLDED,
    SMALLEST_NORMAL,
    ScalePlan,
    StateTensors,
    argument,
)
from fx16.ops.scaling import rule_of


@dataclass(frozen=True)
class Centring:
    """What bounded a domain's k at each end."""

    least: int  # the least k that brings its largest value inside the limit
    most: int  # the most its small end allows (``least`` where nothing is known there)
    small_end: str  # what bounds ``most``: a folded weight, or why nothing does

    def describe(self, k: int) -> str:
        if self.most == self.least:
            return f"k = {k}, the least that fits ({self.small_end})"
        return (
            f"k = {k}, centred between {self.least} (the least that fits) and {self.most} "
            f"(the most at which {self.small_end})"
        )


def centre(
    nodes: list[Node],
    groups: list[list[Node]],
    exponents: dict[int, int],
    plan: ScalePlan,
    state: StateTensors,
    magnitudes: dict,
    limit: float,
) -> tuple[dict[int, int], ScalePlan, dict[int, Centring]]:
    """Each overflow domain's exponent (``exponents``, by index in ``groups``: the least
    that fits, ``plan`` made with them) raised towards the centre (see the module); the
    exponents, the plan made with them, and each domain's ``Centring``."""
    centrings = {}
    for index in sorted(exponents):
        exponent = exponents[index]
        if exponent >= 0:
            continue  # a domain lifted from below the normal range: its own rule
        members = groups[index]
        largest = max(magnitudes.get(node, 0.0) for node in members)
        room, small_end = _small_end_room(members, plan, state, magnitudes)
        top = math.log2(limit / (largest * 2.0**exponent))
        stopped = ""
        for step in range(min(room, max(0, math.floor((room - top) / 2))), 0, -1):
            trial = {**exponents, index: exponent - step}
            wanted = {node: trial[i] for i in trial for node in groups[i]}
            trial_plan = propagate(nodes, wanted, state)
            cost = _costlier(trial_plan, plan, state, magnitudes, limit)
            if cost is None:
                exponents, plan = trial, trial_plan
                break
            stopped = stopped or f"; at {step - exponent} it would {cost}"
        centrings[index] = Centring(-exponent, -exponent + room, small_end + stopped)
    return exponents, plan, centrings


def _small_end_room(
    members: list[Node], plan: ScalePlan, state: StateTensors, magnitudes: dict
) -> tuple[int, str]:
    """How many more halvings the domain's folded weights take (each at its fold in
    ``plan``: a BatchNorm's weight takes the scale before it back, then its own domain's)
    before their largest magnitude passes below ``SMALLEST_FOLDED`` (or below where it
    was), and which one bounds it; 0 where the domain folds no weight."""
    room, bound = None, "it folds no state tensor: its small end is not known"
    for node in members:
        magnitude = magnitudes.get(node, 0.0)
        key = state.key(node)
        if key is None or key not in plan.folds or not magnitude:
            continue
        floor, said = _floor(node)
        scaled = magnitude * 2.0 ** plan.folds[key]
        fits = math.floor(math.log2(scaled / min(magnitude, floor)))
        if room is None or fits < room:
            room, bound = fits, f"{node.name}'s largest, {magnitude:.3g}, folded stays {said}"
    return max(room or 0, 0), bound


def _floor(node: Node) -> tuple[float, str]:
    """How small a fold may make ``node``'s largest magnitude: a weight's stays at least
    ``SMALLEST_FOLDED`` (its small elements normal); an addend's (a bias, a running
    mean) in the normal range."""
    if _added(node):
        return SMALLEST_NORMAL, "in fp16's normal range"
    return SMALLEST_FOLDED, "at least 2**-8"


def _added(node: Node) -> bool:
    """Every reader adds ``node`` (a product's bias, a norm's bias) or subtracts it (a
    BatchNorm's running mean): what it is added to absorbs its rounding."""
    for user in node.users:
        rule = rule_of(user)
        positions = [p for p in (rule.bias, rule.norm_bias, rule.mean) if p is not None]
        if not any(argument(user, position) is node for position in positions):
            return False
    return bool(node.users)


def _costlier(
    new: ScalePlan, old: ScalePlan, state: StateTensors, magnitudes: dict, limit: float
) -> str | None:
    """What ``new`` costs that ``old`` did not (None: nothing): another tensor folded or
    one no longer folded, a runtime multiply more, a fold or scalar leaving fp16's range
    where ``old`` kept it."""
    if new.folds.keys() != old.folds.keys():
        return "change which tensors take the scale"
    if len(new.after) > len(old.after) or len(new.edges) > len(old.edges):
        return "need a runtime multiply"
    for key, exponent in new.folds.items():
        node = state.names[key][0]
        if not _fold_fits(node, exponent, magnitudes, limit) and _fold_fits(
            node, old.folds[key], magnitudes, limit
        ):
            return f"fold {node.name} out of range"
    for at, value in new.scalars.items():
        if 0 < abs(value) < SMALLEST_NORMAL <= abs(old.scalars.get(at, 0)):
            return f"take a scalar of {at[0].name} below fp16's normal range"
    return None


def _fold_fits(node: Node, exponent: int, magnitudes: dict, limit: float) -> bool:
    """A state tensor folded at ``2**exponent`` stays within ``limit``, and its largest
    magnitude above its floor (``_floor``) or where it was."""
    magnitude = magnitudes.get(node, 0.0)
    scaled = magnitude * 2.0**exponent
    if scaled > limit:
        return False
    return exponent >= 0 or scaled >= min(magnitude, _floor(node)[0])
