"""fx16.plan.precedence: each node's precision chosen from ordered rule lists, without a rewrite."""

from dataclasses import replace

import pytest
import torch

import fx16
from fx16.analysis import Fp32RulesAnalysis
from fx16.decisions import Reason
from fx16.passes import ConvertParametersPass
from fx16.pipelines import fp16_stages, run_passes
from fx16.plan.precedence import (
    CAST_TO_FP32_RULES,
    COMPUTE_RULES,
    CREATION_RULES,
    Action,
    choose,
)
from fx16.plan.view import View
from fx16.policy import PrecisionPolicy
from fx16.policy.options import Fp16Options
from fx16.program.nodes import node_dtype
from fx16.report import report_of
from helpers import check_program, export, run

LIMIT = 65504 / 2


class Ops(torch.nn.Module):
    """Ops that read the inputs directly, each a case of one rule."""

    def forward(self, x, small):
        return x.exp(), small * 1e5, x + 1, x.softmax(-1), torch.diff(x)


def _ready(ep, policy):
    """The analyses, the safety rules and the input converters: what the inserter
    reads, with the inserter itself left out."""
    stages = fp16_stages(ep, Fp16Options(policy=policy))
    rules = stages.find(Fp32RulesAnalysis)
    run_passes([*stages.before_decisions, rules, *stages.convert], ep.graph_module)


def test_choices_are_made_without_touching_the_graph():
    x = torch.randn(4, 8) * 12  # exp overflows fp16 on these calibration inputs
    ep = export(Ops(), x, torch.rand(4, 8) * 1e-3)
    policy = replace(PrecisionPolicy.custom(ops={"softmax": "fp32"}), scale_range=False)
    _ready(ep, policy)
    code, ops = ep.graph_module.code, list(ep.graph_module.graph.nodes)
    chosen = {
        node.name: choose(COMPUTE_RULES, View(node, policy, LIMIT))
        for node in ops
        if node.op == "call_function"
    }
    assert ep.graph_module.code == code and list(ep.graph_module.graph.nodes) == ops
    assert not any("fx16.precision" in n.meta for n in ops if n.op == "call_function")
    rules = {name: (choice.action, choice.rule) for name, choice in chosen.items()}
    assert rules == {
        "exp": (Action.FP32, "safety_rule"),
        "mul": (Action.FP32, "scalar_overflow"),
        "add": (Action.LOW, "fits"),
        "softmax": (Action.FP32, "policy_fp32"),
        "diff": (Action.LOW, "fits"),
    }
    assert chosen["exp"].detail.startswith("observed ")
    assert chosen["mul"].detail == "scalar 100000"
    assert chosen["softmax"].detail == "ops['softmax'] = fp32"
    assert chosen["add"].detail == ""
    assert "tables do not list" in chosen["diff"].detail  # an unknown op is said so


def test_each_list_is_ordered_data_that_ends_in_a_rule_that_always_applies():
    assert [rule.name for rule in COMPUTE_RULES] == [
        "policy_widens_model_16bit",
        "no_narrowed_input",
        "opens_model_fp32_region",
        "inside_model_fp32_region",
        "computed_16bit_by_the_model",
        "safety_rule",
        "policy_fp32",
        "policy_follow",
        "fp32_input",
        "scalar_overflow",
        "mixed_float_dtypes",
        "fits",
    ]
    assert [rule.name for rule in CAST_TO_FP32_RULES][0] == "safety_rule"
    assert [rule.name for rule in CREATION_RULES][-1] == "fits"
    ep = export(Ops(), torch.randn(4, 8), torch.randn(4, 8))
    node = next(n for n in ep.graph_module.graph.nodes if n.op == "call_function")
    view = View(node, PrecisionPolicy.default(), LIMIT)
    for rules in (COMPUTE_RULES, CAST_TO_FP32_RULES, CREATION_RULES):
        assert rules[-1].test(view) is not None


class Chain(torch.nn.Module):
    def forward(self, x):
        return x.exp().clamp(max=100.0)


def test_an_fp32_input_is_named_and_a_skipped_cast_back_says_why():
    torch.manual_seed(0)  # exp of the largest element must pass fp16 (seeded: not by chance)
    x = torch.randn(4, 8) * 12
    assert x.max() > 12
    # without scale domains: the fp32 path for a value past the range
    ep = fx16.cast_fp32_to_fp16(export(Chain(), x), policy=PrecisionPolicy(scale_range=False))
    rows = {row.node: row for row in report_of(ep).rows}
    assert rows["exp"].rule == "activation_overflow"
    assert rows["exp"].cast_back_skipped.startswith("observed ")
    assert "beyond 16-bit" in rows["exp"].cast_back_skipped
    assert rows["clamp"].rule == "fp32_input"
    assert rows["clamp"].detail == "from exp: activation_overflow"
    assert "(no cast back: observed" in report_of(ep).table()
    got = ep.module()(x.half())
    expected = x.half().float().exp().clamp(max=100.0)
    assert torch.allclose(got.float(), expected, rtol=1e-3, atol=1e-7)  # exp computed in fp32


class CopyToFp32(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float32, copy=True) * 2


def test_a_cast_of_an_fp32_value_no_pass_decided_on_is_kept_as_an_fp32_input():
    """A pipeline without the user-input converter leaves ``x`` fp32 with no decision
    of its own: the model's copying cast of it is kept, said to read an fp32 input by
    name, with no reason to quote."""
    ep = export(CopyToFp32(), torch.randn(4, 8))
    stages = fp16_stages(ep, Fp16Options())
    rules, parameters = stages.find(Fp32RulesAnalysis), stages.find(ConvertParametersPass)
    run_passes([*stages.before_decisions, rules, parameters], ep.graph_module)
    cast = next(n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.to.dtype)
    choice = choose(CAST_TO_FP32_RULES, View(cast, PrecisionPolicy.default(), LIMIT))
    assert (choice.action, choice.rule) == (Action.KEEP, "fp32_source")
    assert (choice.reason, choice.detail) == (Reason.FP32_INPUT, "from x")


class Bf16TimesInput(torch.nn.Module):
    def forward(self, x, y):
        return x.to(torch.bfloat16) * y


def test_an_op_mixing_the_models_bf16_with_a_narrowed_input_stays_fp32_naming_the_other_dtype():
    """bf16 times fp16 promotes to fp32 in eager: the multiply is computed in fp32, as
    the model's math has it, and the decision names the bf16 input and its dtype."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    ep = fx16.cast_fp32_to_fp16(export(Bf16TimesInput(), x, y))
    rows = {row.node: row for row in report_of(ep).rows}
    assert (rows["mul"].dtype, rows["mul"].rule) == ("float32", "mixed_float_dtypes")
    assert rows["mul"].detail == "to is bfloat16"
    expected = x.half().to(torch.bfloat16).float() * y.half().float()
    assert torch.equal(run(ep, x.half(), y.half())[0].float(), expected.half().float())


class ScaledByCustomOp(torch.nn.Module):
    def forward(self, x):
        from fx16.testing import custom_ops

        return custom_ops.scaled_to(x, 2.0, torch.float32), torch.diff(x)


def test_a_custom_op_computed_16_bit_is_known_and_an_unlisted_aten_op_is_said_to_be_unknown():
    """A user's custom op whose fake kernel takes 16-bit is run in 16-bit and reported
    as fitting, like any op fx16 knows; an ATen op outside fx16's tables is computed as
    its inputs are, and the report says fx16 does not list it."""
    ep = fx16.cast_fp32_to_fp16(export(ScaledByCustomOp(), torch.randn(4, 8)))
    rows = {row.node: row for row in report_of(ep).rows}
    assert (rows["scaled_to"].dtype, rows["scaled_to"].rule) == ("float16", "fits")
    assert rows["scaled_to"].detail == ""
    assert rows["diff"].detail == "an op fx16's tables do not list: computed as its inputs are"


class IntegerRatio(torch.nn.Module):
    def forward(self, x, ids):
        return x * 2, ids / 4


def test_a_float_computed_from_integers_alone_stays_fp32_and_says_so():
    """``ids / 4`` makes fp32 from no float input: nothing was narrowed, so it is left
    as it is, decided fp32 with its reason; the float op beside it fits 16-bit."""
    x, ids = torch.randn(4, 8), torch.randint(0, 9, (4, 8))
    ep = fx16.cast_fp32_to_fp16(export(IntegerRatio(), x, ids))
    rows = {row.node: row for row in report_of(ep).rows}
    assert (rows["div"].dtype, rows["div"].rule) == ("float32", "no_float_input")
    assert rows["div"].chosen_by == "no_narrowed_input"
    assert (rows["mul"].dtype, rows["mul"].rule) == ("float16", "fits")
    assert torch.equal(run(ep, x, ids)[1], ids / 4)


class Bf16IndexInAutocast(torch.nn.Module):
    """An autocast region computes a relu in bf16 that, once back in fp32, decides an
    embedding's index: the unsafe-index rule marks the relu."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)
        self.embed = torch.nn.Embedding(16, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.linear(x).relu()
        buckets = ((h.float() + x).abs() * 4).long().clamp(0, 15)
        return self.embed(buckets).mean(-1)


@pytest.mark.parametrize("policy", ["auto_mixed_bf16", "auto_mixed_conservative"])
def test_an_op_the_model_computes_in_16_bit_is_left_as_it_computes_it(policy):
    """A rule that would make the bf16 relu fp32 widened the weights' product it reads
    (fx16 had narrowed its weight) while the graph still recorded, and asserted, bf16: the
    program failed at run time (found by the fuzzer). It is left as the model computes it."""
    x = torch.randn(3, 4)
    ep = export(Bf16IndexInAutocast().eval(), x, decompose=True)
    fx16.cast_to_16_bit_precision(ep, policy=policy)
    check_program(ep)
    relu = next(n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.relu.default)
    assert relu.meta["val"].dtype == torch.bfloat16
    assert all(node_dtype(arg) == torch.bfloat16 for arg in relu.all_input_nodes)
    with torch.no_grad():  # the same buckets: only the table's rounding differs
        reference = Bf16IndexInAutocast().eval()(x)
    assert (run(ep, x)[0].float() - reference).abs().max() < 1e-2


class Bf16ReluInAutocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.linear(x).relu()
        return h.float() * 2


def test_an_op_the_model_computes_in_16_bit_stays_so_when_only_the_policy_asks_for_fp32():
    """No safety rule and no scalar, only the policy's ``addmm = fp32``: cast to bf16,
    the product the model computes in bf16 (a decomposed autocast region) reads the
    weights fx16 narrowed, and is left as the model computes it, in bf16; the program
    runs."""
    x = torch.randn(3, 4)
    ep = export(Bf16ReluInAutocast().eval(), x, decompose=True)
    bf16 = PrecisionPolicy.named("auto_mixed_bf16")
    fx16.cast_to_16_bit_precision(ep, policy=PrecisionPolicy.custom(bf16, ops={"addmm": "fp32"}))
    check_program(ep)
    rows = {row.node: row for row in report_of(ep).rows}
    assert (rows["addmm"].dtype, rows["addmm"].rule) == ("bfloat16", "left_as_is")
    addmm = next(n for n in ep.graph_module.graph.nodes if n.name == "addmm")
    assert all(node_dtype(arg) == torch.bfloat16 for arg in addmm.all_input_nodes)
    with torch.no_grad():
        reference = Bf16ReluInAutocast().eval()(x)
    assert (run(ep, x)[0].float() - reference).abs().max() < 1e-2


def test_an_op_the_policy_lets_follow_says_which_entry():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    ep = export(Bf16TimesInput(), x, y)
    fx16.cast_fp32_to_fp16(ep, policy=PrecisionPolicy.custom(ops={"mul": "follow"}))
    rows = {row.node: row for row in report_of(ep).rows}
    assert (rows["mul"].rule, rows["mul"].detail) == ("policy_follow", "ops['mul'] = follow")


class Bf16IndexInBranch(torch.nn.Module):
    """The model's own bf16 product and relu inside a cond branch, deciding an index."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.embed = torch.nn.Embedding(16, 4)

    def forward(self, x):
        def branch(x):
            h = (x.bfloat16() @ self.weight.bfloat16()).relu()
            return ((h.float() + x).abs() * 4).long().clamp(0, 15)

        def other(x):
            return (x.abs() * 4).long().clamp(0, 15)

        return self.embed(torch.cond(x.sum() > 0, branch, other, (x,))).mean(-1)


@pytest.mark.parametrize("policy", ["auto_mixed_bf16", "auto_mixed_conservative", "default"])
def test_inside_a_cond_branch_an_op_the_model_computes_in_16_bit_stays_so(policy):
    """The rule holds in a body: the branch's bf16 relu, marked by the unsafe-index rule,
    keeps the dtype the model gives it, and the program runs with the same buckets."""
    x = torch.randn(3, 4).abs()
    ep = export(Bf16IndexInBranch(), x)
    fx16.cast_to_16_bit_precision(ep, policy=policy)
    check_program(ep)
    body = ep.graph_module.true_graph_0
    relu = next(n for n in body.graph.nodes if n.target == torch.ops.aten.relu.default)
    assert relu.meta["val"].dtype == torch.bfloat16
    assert all(node_dtype(arg) == torch.bfloat16 for arg in relu.all_input_nodes)
    with torch.no_grad():
        reference = Bf16IndexInBranch()(x)
    assert (run(ep, x)[0].float() - reference).abs().max() < 1e-2


class Bf16LossInBranch(torch.nn.Module):
    """The program casts to bf16 itself, then an op of autocast's fp32 list reads it:
    in the program's graph and inside a cond branch."""

    def forward(self, x, target):
        def branch(x, target):
            return torch.nn.functional.mse_loss(x.bfloat16(), target.bfloat16()).reshape(1)

        def other(x, target):
            return torch.nn.functional.l1_loss(x.bfloat16(), target.bfloat16()).reshape(1)

        inside = torch.cond(x.sum() > 0, branch, other, (x, target))
        outside = torch.nn.functional.l1_loss(x.bfloat16(), target.bfloat16())
        return inside, outside


def test_the_autocast_policy_widens_the_programs_own_16_bit_inputs_of_fp32_ops():
    """``policy_widens_model_16bit``: an op of autocast's fp32 list computes in fp32 from
    the bf16 values the program made itself, as eager autocast does, in a body too;
    the default policy leaves it as the model computes it."""
    x, target = torch.randn(3, 4).abs() + 0.1, torch.randn(3, 4)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = Bf16LossInBranch()(x, target)
    assert [value.dtype for value in eager] == [torch.float32, torch.float32]
    ep = export(Bf16LossInBranch(), x, target)
    fx16.cast_fp32_to_fp16(ep, policy=PrecisionPolicy.autocast("cpu", torch.bfloat16))
    check_program(ep)
    losses = [
        node
        for module in ep.graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.target in (torch.ops.aten.mse_loss.default, torch.ops.aten.l1_loss.default)
    ]
    assert len(losses) == 3
    for loss in losses:
        assert loss.meta["val"].dtype == torch.float32
        assert loss.meta["fx16.precision"].reason.name == "POLICY"
        op = loss.target._opname
        assert loss.meta["fx16.precision"].detail == f"op_table['{op}'] = fp32", op
    got = run(ep, x, target)
    assert [value.dtype for value in got] == [torch.float32, torch.float32]
    for ours, theirs in zip(got, eager, strict=True):
        torch.testing.assert_close(ours, theirs)
    kept = export(Bf16LossInBranch(), x, target)
    fx16.cast_fp32_to_fp16(kept)
    assert [value.dtype for value in run(kept, x, target)] == [torch.bfloat16] * 2


class Creations(torch.nn.Module):
    """Two creation ops: one made from nothing, one ``*_like`` of the (narrowed) input."""

    def forward(self, x):
        return x * torch.ones(8) + torch.zeros_like(x)


@pytest.mark.parametrize(
    ("ops", "expected"),
    [
        ({}, {"ones": ("float16", "fits", ""), "zeros_like": ("float16", "fits", "")}),
        (
            {"ones": "follow", "zeros_like": "follow"},
            {
                "ones": ("float32", "policy_follow", "ops['ones'] = follow"),
                "zeros_like": ("float16", "policy_follow", "ops['zeros_like'] = follow"),
            },
        ),
        (
            {"ones": "fp32", "zeros_like": "fp32"},
            {
                "ones": ("float32", "policy_fp32", "ops['ones'] = fp32"),
                "zeros_like": ("float32", "policy_fp32", "ops['zeros_like'] = fp32"),
            },
        ),
    ],
    ids=["sixteen_bit", "follow", "fp32"],
)
def test_creation_ops_are_made_16_bit_follow_their_input_or_stay_fp32_as_the_policy_says(
    ops, expected
):
    """A creation op that follows is made as the model makes it (fp32) unless it is the
    ``*_like`` of a 16-bit value, which it follows; the values are eager's either way."""
    x = torch.randn(4, 8)
    ep = fx16.cast_fp32_to_fp16(export(Creations(), x), policy=PrecisionPolicy.custom(ops=ops))
    rows = {row.node: row for row in report_of(ep).rows}
    got = {name: (rows[name].dtype, rows[name].chosen_by, rows[name].detail) for name in expected}
    assert got == expected
    (got,) = run(ep, x)
    assert torch.equal(got.float(), x.half().float())  # x * 1 + 0 in either dtype


class PolicyFp32ThenAdd(torch.nn.Module):
    def forward(self, x):
        return x.softmax(-1) + 1


@pytest.mark.parametrize("cast_back", [True, False], ids=["cast_back", "no_cast_back"])
def test_an_op_the_policy_keeps_fp32_hands_its_consumers_a_16_bit_copy_only_with_cast_back(
    cast_back,
):
    """A consumer that follows its input computes 16-bit from the cast-back copy, and
    fp32 from the fp32 result without one (as eager autocast's ops follow)."""
    x = torch.randn(4, 8)
    ops = {"softmax": "fp32", "add": "follow"}
    policy = PrecisionPolicy.custom(ops=ops, cast_back=cast_back)
    ep = fx16.cast_fp32_to_fp16(export(PolicyFp32ThenAdd(), x), policy=policy)
    rows = {row.node: row for row in report_of(ep).rows}
    assert (rows["softmax"].dtype, rows["softmax"].chosen_by) == ("float32", "policy_fp32")
    assert rows["add"].dtype == ("float16" if cast_back else "float32")
    assert rows["add"].chosen_by == "policy_follow"
    (got,) = run(ep, x)
    assert torch.allclose(got.float(), x.half().float().softmax(-1) + 1, rtol=1e-3)


class RegionAndBack(torch.nn.Module):
    """The model's fp32 region (``x.half().float()``, an exp in it) and its cast to fp32
    of the region's result, which is the way back to the rest of the program."""

    def forward(self, x):
        return x.half().float().exp().float() + 1


REGION = ("float32", "opens_model_fp32_region", "the policy's explicit_fp32='keep'")
IN_REGION = ("float32", "inside_model_fp32_region", "the policy's explicit_fp32='keep'")


@pytest.mark.parametrize(
    ("policy", "expected", "out_dtype"),
    [
        (
            PrecisionPolicy.custom(explicit_fp32="keep"),
            {
                "to_1": REGION,
                "exp": IN_REGION,
                "to_2": ("float16", "way_back_from_model_fp32_region", ""),
                "add": ("float16", "fits", ""),
            },
            torch.float16,
        ),
        (
            PrecisionPolicy.custom(explicit_fp32="keep", cast_back=False),
            {
                "to_1": REGION,
                "exp": IN_REGION,
                "add": ("float32", "inside_model_fp32_region", "from exp: explicit_fp32"),
            },
            torch.float32,
        ),
        (
            PrecisionPolicy.custom(PrecisionPolicy.auto_mixed_bf16(), explicit_fp32="keep"),
            {
                "to_1": REGION,
                "exp": IN_REGION,
                "to_2": ("bfloat16", "way_back_from_model_fp32_region", ""),
                "add": ("bfloat16", "fits", ""),
            },
            torch.bfloat16,
        ),
    ],
    ids=["keep", "keep_without_cast_back", "bf16_keep"],
)
def test_the_way_back_from_a_kept_region_is_16_bit_only_where_the_policy_casts_back(
    policy, expected, out_dtype
):
    """With cast-back, the model's cast to fp32 after its region is retargeted at the
    16-bit dtype and the rest computes 16-bit; without, that cast reads an fp32 value
    and is kept (then dropped as a no-op), and the add stays in the region's fp32."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    ep = fx16.cast_fp32_to_fp16(export(RegionAndBack(), x), policy=policy)
    rows = {row.node: row for row in report_of(ep).rows if row.op not in ("input", "output")}
    got = {name: (row.dtype, row.chosen_by, row.detail) for name, row in rows.items()}
    assert {name: got.get(name) for name in expected} == expected
    assert "to_2" in expected or "to_2" not in got
    (out,) = run(ep, x)
    assert out.dtype == out_dtype
    want = x.half().double().exp() + 1
    assert float((out.double() - want).abs().max() / want.abs().max()) < 4e-3


class AutocastThenFloat(torch.nn.Module):
    """The model's cast to fp32 of what its own bf16 autocast region computed."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.mm(x, x.t())
        return h.float() + 1


@pytest.mark.parametrize(
    ("ops", "expected"),
    [
        ({}, (Action.RETARGET, None, "policy_16bit", "")),  # the decision is the region's
        ({"to": "fp32"}, (Action.FP32, Reason.POLICY, "policy_fp32", "ops['to'] = fp32")),
    ],
    ids=["sixteen_bit", "fp32"],
)
def test_the_models_cast_to_fp32_of_a_16_bit_value_is_retargeted_or_kept_as_the_policy_says(
    ops, expected
):
    ep = export(AutocastThenFloat(), torch.randn(4, 8))
    policy = PrecisionPolicy.custom(ops=ops)
    _ready(ep, policy)
    (cast,) = (node for node in ep.graph.nodes if node.name == "to")
    choice = choose(CAST_TO_FP32_RULES, View(cast, policy, LIMIT))
    assert (choice.action, choice.reason, choice.rule, choice.detail) == expected
