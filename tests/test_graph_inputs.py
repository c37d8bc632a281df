"""The program's inputs are decided by precedence lists, as ops are
(``fx16.plan.graph_inputs``): the converters apply the choice, and the report says which
rule chose for every parameter and input."""

import torch
from torch import nn

import fx16
from fx16.decisions import Decision, Reason
from fx16.plan.graph_inputs import (
    STATE_RULES,
    USER_INPUT_RULES,
    InputView,
    plan_state,
)
from fx16.plan.precedence import Action, choose
from fx16.policy import PrecisionPolicy
from fx16.report import report_of
from helpers import export
from models import MLP

LIMIT = 65504 / 2


def _view(node, fit=(False, False, False), rule=None, policy=None, target="w"):
    return InputView(node, policy or PrecisionPolicy.default(), LIMIT, rule, target, lambda: fit)


def _placeholder(name="p_w"):
    node = torch.fx.Graph().placeholder(name)
    node.meta["val"] = torch.zeros(2)
    return node


def test_each_state_rule_chooses_in_its_order():
    node = _placeholder()
    forced = Decision(torch.float32, Reason.FORCED, "force_fp32='p_w'")
    cases = [
        (_view(node, (True, False, False), rule=forced), "safety_rule", Reason.FORCED),
        (_view(node, (True, False, True)), "value_overflow", Reason.VALUE_OVERFLOW),
        (_view(node, (False, True, True)), "value_below_range", Reason.VALUE_BELOW_RANGE),
        (_view(node), "fits", Reason.FITS),
    ]
    for view, rule, reason in cases:
        choice = choose(STATE_RULES, view)
        assert (choice.rule, choice.reason) == (rule, reason)


def test_the_policy_keeps_a_module_fp32_before_its_values_are_read():
    node = _placeholder("p_head_w")
    policy = PrecisionPolicy.custom(PrecisionPolicy.default(), modules={"head": "fp32"})
    view = _view(node, policy=policy, target="head.w")
    view._fit = None  # asked for, it would raise: the policy chooses first
    choice = choose(STATE_RULES, view)
    assert (choice.rule, choice.reason, choice.detail) == (
        "policy_fp32",
        Reason.POLICY,
        "modules['head'] = fp32",
    )


def test_a_tied_tensor_stays_fp32_under_every_name_where_one_does():
    kept, tied = _placeholder("p_a"), _placeholder("p_b")
    views = [(_view(kept, (True, False, False), target="a"), 7), (_view(tied, target="b"), 7)]
    first, second = plan_state(views)
    assert first.reason is Reason.VALUE_OVERFLOW
    assert (second.action, second.reason, second.rule) == (
        Action.FP32,
        Reason.SHARED_FP32,
        "shared_fp32",
    )
    assert second.detail == "a stays fp32"


def test_a_user_input_kept_by_keep_io_types_is_chosen_so():
    node = _placeholder("x")
    policy = PrecisionPolicy.default(keep_io_types=True)
    choice = choose(USER_INPUT_RULES, InputView(node, policy, LIMIT, None))
    assert (choice.action, choice.rule, choice.reason) == (Action.KEEP, "keep_io", Reason.KEEP_IO)


class WideHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 4)
        with torch.no_grad():
            self.head.weight[0, 0] = 1e6

    def forward(self, x):
        return self.head(self.body(x))


def test_every_input_row_of_the_report_says_which_rule_chose():
    torch.manual_seed(0)
    policy = PrecisionPolicy.default(scale_range=False)  # the weight's own rule
    ep = fx16.cast_fp32_to_fp16(export(WideHead(), torch.randn(2, 8)), policy=policy)
    rows = {row.node: row for row in report_of(ep).rows if row.op in ("parameter", "input")}
    assert rows["p_head_weight"].chosen_by == "value_overflow"
    assert rows["p_body_weight"].chosen_by == "fits"
    assert rows["x"].chosen_by == "fits"
    torch.manual_seed(0)
    forced = fx16.cast_fp32_to_fp16(export(MLP(), torch.randn(4, 8)), force_fp32=["linear_1"])
    rows = {row.node: row for row in report_of(forced).rows}
    assert rows["p_layers_1_weight"].chosen_by == "stored_as_read"  # every reader is fp32
    assert all(row.chosen_by for row in rows.values())


def test_an_input_an_earlier_cast_kept_fp32_stays_so_with_its_decision():
    """A norm over two elements that cancel: the first cast keeps it fp32 with the values
    it reads (the conditioning finding's chain: weight, bias, x). Cast again, the verdict
    check measures a program whose output the first cast already rounds to fp16 and
    finds fp32 changes nothing; the norm keeps its earlier decision, and so must what it
    reads: before, the weight and bias were stored fp16 and read by the fp32 norm
    directly (the program failed: "mixed dtype (CPU)")."""
    from fx16.testing.random_programs import RandomProgram

    torch.manual_seed(0)
    model = RandomProgram(2, [("layer_norm", 0, 0, 1e-9)], []).eval()
    x = torch.tensor([[1.4587, 1.8898], [-0.1599, 0.4862], [0.7101, -1.1112]])
    ids = torch.tensor([[12, 8], [14, 14], [12, 1]])
    ep = torch.export.export(model, (x, ids))
    fx16.cast_to_16_bit_precision(ep, policy="always_fp16")
    once = {name: t.dtype for name, t in ep.state_dict.items()}
    inputs_once = [n.meta["val"].dtype for n in ep.graph.find_nodes(op="placeholder")]
    first = {row.node: row for row in report_of(ep).rows}
    assert first["p_norm_weight"].dtype == "float32"
    expected = ep.module()(x, ids)[0]
    fx16.cast_to_16_bit_precision(ep, policy="always_fp16")
    assert {name: t.dtype for name, t in ep.state_dict.items()} == once
    assert [n.meta["val"].dtype for n in ep.graph.find_nodes(op="placeholder")] == inputs_once
    rows = {row.node: row for row in report_of(ep).rows}
    for name in ("p_norm_weight", "p_norm_bias", "x"):
        assert (rows[name].dtype, rows[name].reason) == ("float32", first[name].reason)
        assert rows[name].chosen_by == "decided_earlier"
    assert torch.equal(ep.module()(x, ids)[0], expected)


def test_an_earlier_fp32_decision_is_chosen_before_the_values_are_read():
    node = _placeholder()
    node.meta["fx16.precision"] = Decision(torch.float32, Reason.ILL_CONDITIONED, "feeds n")
    view = _view(node)
    view._fit = None  # asked for, it would raise: the earlier decision chooses first
    for rules in (STATE_RULES, USER_INPUT_RULES):
        choice = choose(rules, view)
        assert (choice.action, choice.rule) == (Action.FP32, "decided_earlier")
        assert (choice.reason, choice.detail) == (Reason.ILL_CONDITIONED, "feeds n")
    node.meta["fx16.precision"] = Decision(torch.float16, Reason.FITS)
    assert (
        choose(USER_INPUT_RULES, InputView(node, PrecisionPolicy.default(), LIMIT, None)).rule
        == "fits"
    )
