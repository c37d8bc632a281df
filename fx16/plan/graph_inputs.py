"""Which dtype the program's inputs take, and why: the precedence lists of its state
tensors (parameters, buffers, constants) and of its user inputs, chosen with the same
``choose`` as the compute ops' lists (``fx16.plan.precedence``). ``ConvertParametersPass``
and ``ConvertUserInputsPass`` apply what these choose, and keep the rule that chose on the
placeholder (``meta["fx16.planned"]``: the report's ``chosen_by``).

Reads: the placeholder's safety-rule verdict, its calibration, the policy, and for a
state tensor whether its values fit 16-bit. Writes: nothing.
"""

from collections.abc import Callable

import torch
from torch.fx import Node

from fx16 import meta
from fx16.decisions import PRECISION, Decision, Reason
from fx16.ops.scaling import Kind, rule_of
from fx16.plan.precedence import Action, Choice, Rule, choose
from fx16.plan.steps import Planned
from fx16.policy import Precision, PrecisionPolicy


class InputView:
    """What the input rules read of one placeholder. ``rule``: the safety rule keeping
    it fp32 (or None); ``target``: a state tensor's name; ``fit``: for a state tensor,
    ``() -> (overflows, may_flush, below_normal)``, asked once, where a rule needs it."""

    __slots__ = ("node", "policy", "limit", "rule", "target", "_fit", "_fitted")

    def __init__(
        self,
        node: Node,
        policy: PrecisionPolicy,
        limit: float,
        rule: Decision | None,
        target: str | None = None,
        fit: Callable[[], tuple[bool, bool, bool]] | None = None,
    ) -> None:
        self.node, self.policy, self.limit, self.rule = node, policy, limit, rule
        self.target, self._fit, self._fitted = target, fit, None

    @property
    def fitted(self) -> tuple[bool, bool, bool]:
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted


def _safety_rule(view: InputView) -> Choice | None:
    """A safety rule (or the caller's ``force_fp32``) keeps it fp32."""
    rule = view.rule
    return Choice(Action.FP32, rule.reason, rule.detail) if rule is not None else None


def _decided_earlier(view: InputView) -> Choice | None:
    """An earlier cast kept it fp32 (a safety rule then, its readers all computing in
    fp32, ``StoreAsReadPass``): the ops that read it were decided then too, and keep
    those decisions (an fp32 norm reads its weight as it is), so a second cast finds
    what the first did, even where a rule now judges otherwise (the verdict check
    measures a program whose outputs the first cast already rounded)."""
    earlier = view.node.meta.get(PRECISION)
    if earlier is not None and earlier.dtype == torch.float32:
        return Choice(Action.FP32, earlier.reason, earlier.detail)
    return None


def _policy_fp32(view: InputView) -> Choice | None:
    """The policy keeps it fp32 (by kind "boundary", module path or node name)."""
    if view.policy.precision_for(view.node, view.target) != Precision.LOW:
        entry = view.policy.matching_entry(view.node, view.target)[1]
        return Choice(Action.FP32, Reason.POLICY, entry)
    return None


def _value_overflow(view: InputView) -> Choice | None:
    """A finite element beyond the 16-bit maximum."""
    return Choice(Action.FP32, Reason.VALUE_OVERFLOW) if view.fitted[0] else None


def _value_below_range(view: InputView) -> Choice | None:
    """Every element below the 16-bit normal range (zeros or subnormals in 16-bit);
    except a bias a scale domain folded there (a conv's bias of 0.08 at 2**-13): it is
    added to a product carried at the same scale, whose values absorb its rounding, and
    the user's tensor was in range."""
    if not view.fitted[2]:
        return None
    if _folded_bias(view.node):
        detail = f"a bias folded by 2**{meta.scale_exponent(view.node)} into its product's scale"
        return Choice(Action.LOW, Reason.FITS, detail)
    return Choice(Action.FP32, Reason.VALUE_BELOW_RANGE)


def _folded_bias(node: Node) -> bool:
    """``node`` is a state tensor a scale domain folded down, and every op that reads it
    adds it to a product (its bias)."""
    if meta.scale_exponent(node) >= 0 or not node.users:
        return False
    for user in node.users:
        rule = rule_of(user) if user.op == "call_function" else None
        if rule is None or rule.kind is not Kind.PRODUCT or rule.bias is None:
            return False
        if rule.bias >= len(user.args) or user.args[rule.bias] is not node:
            return False
    return True


def _observed_overflow(view: InputView) -> Choice | None:
    """Its calibration values exceed the 16-bit maximum over the margin."""
    if meta.overflows(view.node, view.limit):
        return Choice(Action.FP32, Reason.ACTIVATION_OVERFLOW)
    return None


def _keep_io(view: InputView) -> Choice | None:
    """The policy's ``keep_io_types`` keeps it at its dtype: a cast after it feeds the
    program 16-bit."""
    return Choice(Action.KEEP, Reason.KEEP_IO) if view.policy.keeps_io(view.node.name) else None


def _fits(view: InputView) -> Choice:
    """Nothing keeps it wide: stored (or passed) in 16-bit."""
    return Choice(Action.LOW, Reason.FITS)


STATE_RULES = (
    Rule("safety_rule", _safety_rule),
    Rule("decided_earlier", _decided_earlier),
    Rule("policy_fp32", _policy_fp32),
    Rule("value_overflow", _value_overflow),
    Rule("value_below_range", _value_below_range),
    Rule("fits", _fits),
)

USER_INPUT_RULES = (
    Rule("safety_rule", _safety_rule),
    Rule("decided_earlier", _decided_earlier),
    Rule("observed_overflow", _observed_overflow),
    Rule("policy_fp32", _policy_fp32),
    Rule("keep_io", _keep_io),
    Rule("fits", _fits),
)


def plan_state(views: list[tuple[InputView, int]]) -> list[Choice]:
    """The choice for each state tensor, given as ``(view, id of its tensor)``: its list's
    choice, except that a tensor stored under several names is stored once, so where
    one name stays fp32 every name does (``shared_fp32``, naming the one that stays)."""
    choices = [choose(STATE_RULES, view) for view, _ in views]
    kept: dict[int, str] = {}
    for (view, tensor), choice in zip(views, choices):
        if choice.action != Action.LOW:
            kept.setdefault(tensor, view.target)
    for index, ((_, tensor), choice) in enumerate(zip(views, choices)):
        if choice.action == Action.LOW and tensor in kept:
            detail = f"{kept[tensor]} stays fp32"
            choices[index] = Choice(Action.FP32, Reason.SHARED_FP32, detail, "shared_fp32")
    return choices


def record_rule(node: Node, rule: str) -> None:
    """Keep the name of the rule that chose on the placeholder, for the report's
    ``chosen_by`` (a later stage that changes the decision records its own)."""
    node.meta[meta.PLANNED] = Planned(rule)
