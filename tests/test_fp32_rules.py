"""Fp32RulesAnalysis: each safety rule decides alone, the first one wins, and a new rule
needs no change to the pass that applies them."""

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import fx16
from benchmarks.range_flows import RunningMean
from fx16 import PreconditionError, meta
from fx16.analysis import (
    CalibrationAnalysis,
    ConditioningAnalysis,
    ExplicitFp32Analysis,
    Fp32RulesAnalysis,
    RoutingAnalysis,
    UnsafeIndexAnalysis,
)
from fx16.analysis.fp32_rules import (
    AccuracyBudgetRule,
    ConditioningRule,
    ObservedBelowRangeRule,
    ObservedOverflowRule,
    RouterRule,
    UnsafeIndexRule,
    fp32_rule,
)
from fx16.analysis.safety_rule import RuleContext
from fx16.analysis.scale_domains import scale_domains
from fx16.decisions import PRECISION, Reason
from fx16.passes import ConvertParametersPass, ConvertUserInputsPass, InsertFP16CastsPass
from fx16.pipelines import run_passes, without_rules
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.report import report_of
from helpers import assert_same_state, check_program, export, state_snapshot


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.table = nn.Embedding(8, 4)

    def forward(self, x):
        big = self.fc(x) * 1e5
        looked_up = self.table((x.tanh() * 3 + 4).long())  # a float that decides an index
        return big, looked_up, torch.relu(self.fc(x))


def _rules(ep, rules):
    Fp32RulesAnalysis(rules)(ep.graph_module)
    return {n.name: fp32_rule(n) for n in ep.graph_module.graph.nodes}


def test_each_rule_alone():
    ep = export(Model(), torch.randn(2, 8))
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    UnsafeIndexAnalysis()(ep.graph_module)
    overflow = _rules(ep, [ObservedOverflowRule(65504 / 2)])
    assert (
        overflow["mul"].reason == Reason.ACTIVATION_OVERFLOW
        and "observed" in overflow["mul"].detail
    )
    assert overflow["linear"] is None
    index = _rules(ep, [UnsafeIndexRule()])
    assert index["tanh"].reason == Reason.UNSAFE_INDEX and index["mul"] is None
    assert index["tanh"].detail == ""  # the reason says it all: no detail to add
    budget = _rules(ep, [AccuracyBudgetRule(frozenset({"relu"}))])
    assert [name for name, rule in budget.items() if rule] == ["relu"]
    with pytest.raises(PreconditionError, match="reads what ConditioningAnalysis finds"):
        _rules(ep, [ConditioningRule()])  # its analysis has not run: not "nothing found"
    ConditioningAnalysis(Program(ep))(ep.graph_module)
    assert not any(_rules(ep, [ConditioningRule()]).values())  # nothing ill-conditioned here


def test_a_pipeline_without_the_index_analysis_names_it():
    """Dropping UnsafeIndexAnalysis from fp16_passes would cast the floats that decide
    an index: the rules that read it refuse to run, naming it; the program is intact."""
    ep = export(Model(), torch.randn(2, 8))
    before = state_snapshot(ep)
    passes = [p for p in fx16.fp16_passes(ep) if not isinstance(p, UnsafeIndexAnalysis)]
    with pytest.raises(PreconditionError, match="UnsafeIndexAnalysis"):
        run_passes(passes, ep.graph_module)
    assert_same_state(before, state_snapshot(ep))
    trimmed = without_rules(fx16.fp16_passes(ep), UnsafeIndexRule, RouterRule)
    run_passes(
        [p for p in trimmed if not isinstance(p, (UnsafeIndexAnalysis, RoutingAnalysis))],
        ep.graph_module,
    )


def test_the_first_rule_that_applies_wins():
    ep = export(Model(), torch.randn(2, 8))
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    rules = _rules(ep, [AccuracyBudgetRule(frozenset({"mul"})), ObservedOverflowRule(1.0)])
    assert rules["mul"].reason == Reason.ACCURACY_FALLBACK


@dataclass(frozen=True)
class KeepRelu:
    """A user's own rule: every relu stays fp32."""

    reason = Reason.POLICY

    def applies(self, node, context):
        return "the user's rule" if getattr(node.target, "_opname", None) == "relu" else None


def test_a_new_rule_is_applied_by_the_pass_without_changing_it():
    ep = export(Model(), torch.randn(2, 8))
    program = Program(ep)
    run_passes(
        [
            Fp32RulesAnalysis([KeepRelu()]),
            ExplicitFp32Analysis(program),
            ConvertParametersPass(program),
            ConvertUserInputsPass(program),
            InsertFP16CastsPass(program),
        ],
        ep.graph_module,
    )
    nodes = {n.name: n for n in ep.graph_module.graph.nodes}
    assert nodes["relu"].meta[PRECISION].detail == "the user's rule"
    assert nodes["relu"].meta["val"].dtype == torch.float32
    assert nodes["linear_1"].meta["val"].dtype == torch.float16
    check_program(ep)


def test_the_inserter_used_alone_names_the_analyses_it_reads_and_changes_nothing():
    ep = export(Model(), torch.randn(2, 8))
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    code = ep.graph_module.code
    with pytest.raises(PreconditionError, match="ExplicitFp32Analysis, Fp32RulesAnalysis finds"):
        InsertFP16CastsPass(Program(ep))(ep.graph_module)
    assert ep.graph_module.code == code
    assert not any(PRECISION in n.meta for n in ep.graph_module.graph.nodes)


class WriteIntoALinear(nn.Module):
    """``h = linear(x)``, then ``h.view(-1)[:1].add_(x.sum() * scale)``: a write in place."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        h.view(-1)[:1].add_(x.abs().sum() * self.scale)
        return h * 2


@pytest.mark.parametrize("scale, kept", [(1e4, True), (1.0, False)])
def test_a_write_that_overflows_keeps_the_op_that_made_its_storage_fp32(scale, kept):
    """The overflow rule reaches back from the write to the op that made the written
    storage (an in-place op cannot change its target's dtype); a write that fits keeps
    nothing fp32."""
    ep = export(WriteIntoALinear(scale).eval(), torch.randn(2, 8))
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    rules = _rules(ep, [ObservedOverflowRule(65504 / 2)])
    written = next(n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.add_.Tensor)
    assert (rules["linear"] is not None) == kept
    if kept:
        assert rules["linear"].dtype == torch.float32
        assert rules["linear"].reason == Reason.ACTIVATION_OVERFLOW
        assert rules["linear"].detail.startswith(f"a write in place ({written.name}) of ")
        assert rules["view"] is None  # a view follows its base's dtype


class CustomOps(nn.Module):
    def forward(self, x):
        from fx16.testing import custom_ops

        return custom_ops.scaled_to(x, 2.0, torch.float32), custom_ops.fp32_only(x)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_the_rules_that_read_no_analysis_judge_custom_ops_in_the_dtype_asked_for(low):
    """``needing_nothing`` (a pipeline that runs no analysis) keeps the forced, budget's
    and kernel rules, the latter judging in ``low``: an op whose fake kernel takes
    ``low`` is left alone, one that refuses it is kept as exported; the rules that read
    an analysis are left out."""
    ep = export(CustomOps(), torch.randn(2, 8))
    analysis = Fp32RulesAnalysis.needing_nothing(low, 65504 / 2, frozenset({"x"}))
    standard = Fp32RulesAnalysis.standard(low, 65504 / 2).rules
    names = [type(rule).__name__ for rule in standard if not getattr(rule, "needs", ())]
    assert [type(rule).__name__ for rule in analysis.rules] == names
    assert {"ForcedRule", "AccuracyBudgetRule", "FakeKernelRule", "NoLowKernelRule"} <= set(names)
    rules = _rules(ep, analysis.rules)
    assert ep.graph_module.meta["fx16.fp32_rules"] == names
    assert rules["scaled_to"] is None
    assert rules["fp32_only"].dtype == rules["x"].dtype == torch.float32
    assert (rules["fp32_only"].reason, rules["fp32_only"].detail) == (Reason.NO_FAKE_KERNEL, "")
    assert (rules["x"].reason, rules["x"].detail) == (Reason.FORCED, "force_fp32='x'")


class AfterACond(nn.Module):
    def forward(self, x):
        y = torch.cond(x.sum() > 0, lambda a: a * 2, lambda a: a * 3, (x,))
        return y * 1e5


def test_the_rules_judge_the_nodes_after_a_higher_order_ops_bodies():
    """A cond's branches are read through get_attr nodes in the root graph: the rules
    judge every call after them (the multiply past 16-bit's range), and each body's
    own nodes."""
    ep = export(AfterACond(), torch.randn(2, 8))
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    rules = _rules(ep, [ObservedOverflowRule(65504 / 2)])
    assert any(n.op == "get_attr" for n in ep.graph_module.graph.nodes)
    assert rules["mul"].reason == Reason.ACTIVATION_OVERFLOW


def test_the_analysis_hands_back_the_module_it_was_given_unchanged():
    """The PassBase contract torch's PassManager reads: the same graph module, and
    ``modified`` False (an analysis writes meta only)."""
    ep = export(Model(), torch.randn(2, 8))
    code = ep.graph_module.code
    result = Fp32RulesAnalysis([AccuracyBudgetRule(frozenset({"relu"}))])(ep.graph_module)
    assert result.graph_module is ep.graph_module
    assert result.modified is False
    assert ep.graph_module.code == code


class TinyMultiplier(nn.Module):
    """``lin(x) * 1e-8 * 1e8``: the middle value lies below fp16's smallest subnormal."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * 1e-8 * 1e8


class TinyWeight(nn.Module):
    """A weight of 1e-9s read by a product, then a reciprocal and a scale back up."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 1e-9)

    def forward(self, x):
        y = x @ self.w
        return 1 / y, y * 1e6


@pytest.mark.parametrize("scale_range", [True, False])
@pytest.mark.parametrize("model_type", [TinyMultiplier, TinyWeight])
def test_a_value_observed_below_the_normal_range_never_fits(model_type, scale_range):
    """Once both were cast to fp16 and reported as fitting: all zeros (the multiplier),
    inf and 100% off (the weight). By default a scale domain carries the value at a
    power of two folded into the scalar (the weight), so everything computes in 16-bit;
    without scale domains the value below the range computes in fp32
    (``activation_below_range``; the weight ``value_below_range``). Either way the
    outputs are fp32's within 16-bit's rounding; the linear before the multiplier
    stays 16-bit."""
    from helpers import fp64_reference, max_error, run

    torch.manual_seed(0)
    model, x = model_type().eval(), torch.randn(4, 8)
    policy = PrecisionPolicy(scale_range=scale_range)
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy)
    check_program(ep)
    reasons = {n.name: n.meta[PRECISION].reason for n in ep.graph.nodes if PRECISION in n.meta}
    below = "mul" if model_type is TinyMultiplier else "matmul"
    if scale_range:
        assert reasons[below] is Reason.FITS and scale_domains(ep.graph_module)
    else:
        assert reasons[below] is Reason.ACTIVATION_BELOW_RANGE
    if model_type is TinyWeight:
        assert reasons["p_w"] is (Reason.FITS if scale_range else Reason.VALUE_BELOW_RANGE)
    else:
        assert reasons["linear"] is Reason.FITS
    outputs = run(ep, x)
    assert all(bool(out.isfinite().all()) and bool((out != 0).any()) for out in outputs)
    assert max_error(fp64_reference(model, x), outputs) < 1e-2


def test_a_value_that_reaches_the_normal_range_is_not_kept():
    """A product of 1e-4s is subnormal in fp16 only in some elements: it fits."""
    analysis = ObservedBelowRangeRule(torch.float16)
    node = torch.fx.Graph().call_function(torch.ops.aten.mul.Tensor, (1.0, 2.0))
    node.meta["val"] = torch.zeros(2)
    for largest, kept in ((1e-4, False), (5e-5, True), (0.0, False)):
        node.meta[meta.OBSERVED_MAX_ABS] = largest
        assert (analysis.applies(node, RuleContext(None, None)) is not None) is kept, largest


def test_a_callers_force_fp32_is_said_as_forced_not_as_an_accuracy_fallback():
    """``force_fp32=["linear_1"]`` with no budget once reported ``accuracy_fallback:
    returned to fp32 to meet the accuracy budget``; its own reason names the option and
    the name that matched. A budget search's choices keep theirs (tests/test_budget.py)."""
    from models import MLP

    torch.manual_seed(0)
    ep = fx16.cast_fp32_to_fp16(export(MLP(), torch.randn(4, 8)), force_fp32=["linear_1"])
    (row,) = [row for row in fx16.report.report_of(ep).rows if row.node == "linear_1"]
    assert (row.dtype, row.rule) == ("float32", "forced")
    decided = next(n for n in ep.graph.nodes if n.name == "linear_1").meta[PRECISION]
    assert (decided.reason, decided.detail) == (Reason.FORCED, "force_fp32='linear_1'")


@pytest.mark.parametrize("decompose", [False, True], ids=["in_place", "buffer_mutation"])
def test_a_buffer_accumulated_across_calls_stays_fp32(decompose):
    """Input graph: total.add_(linear(x).sum(0)); count.add_(4); total / count (or their
    functional form, written back by the signature). Output: total and count fp32 with
    the cause and after how many calls 16-bit would lose updates; the linear 16-bit; the
    overwritten cache 16-bit. The running mean of 10,000 calls stays within fp16
    rounding of one call's value (16-bit state: 0.67 off)."""
    torch.manual_seed(0)
    x = torch.rand(4, 8)
    model = RunningMean().eval()
    ep = fx16.cast_fp32_to_fp16(export(model, x, decompose=decompose))
    rows = {row.node: row for row in report_of(ep).rows}
    for name in ("b_total", "b_count"):
        assert rows[name].rule == "accumulating_state" and rows[name].dtype == "float32"
        assert "round away after about 2048 calls" in rows[name].detail
    assert rows["b_cache"].dtype == "float16"
    assert [row.dtype for row in rows.values() if row.product] == ["float16"]
    module = ep.module()
    args = fx16.inputs_for(ep, x)[0]
    with torch.no_grad():
        expected = model.linear.double()(x.double()).sum(0) / 4
        for _ in range(10_000):
            mean, _ = module(*args)
    assert float((mean.double() - expected).abs().max() / expected.abs().max()) < 4e-3


def test_the_accumulating_state_rule_walks_the_graph_as_often_for_any_state(monkeypatch):
    """Asked of every node, the rule walks the graph's nodes as many times for a stack
    of one MLP (4 weights) as for eight (32): not once per state tensor, which made a
    96-layer GPT-2's 1,157 weights the cast's costliest stage (5.6 of 6.4 s)."""
    from fx16.analysis.safety_rules.precision import AccumulatingStateRule
    from models import MLP

    listed = torch.fx.Graph.nodes
    walks = []
    monkeypatch.setattr(
        torch.fx.Graph, "nodes", property(lambda graph: walks.append(1) or listed.fget(graph))
    )

    def walks_for(depth: int) -> int:
        torch.manual_seed(0)
        ep = export(nn.Sequential(*(MLP((8, 8, 8)) for _ in range(depth))), torch.randn(4, 8))
        nodes, rule = list(listed.fget(ep.graph)), AccumulatingStateRule()
        context = RuleContext(Program(ep), ep.graph_module)
        walks.clear()
        assert all(rule.applies(node, context) is None for node in nodes)
        return len(walks)

    assert walks_for(1) == walks_for(8)


def test_a_rule_whose_markers_no_node_holds_is_not_asked(monkeypatch):
    """A rule that reads calibration's observations is asked of no node when nothing was
    observed (an uncalibrated cast), and of every node once a calibration ran; what it
    finds then is what it finds asked alone."""
    asked = []
    applies = ObservedOverflowRule.applies
    monkeypatch.setattr(
        ObservedOverflowRule,
        "applies",
        lambda rule, node, context: asked.append(node) or applies(rule, node, context),
    )
    ep = export(Model(), torch.randn(2, 8))
    CalibrationAnalysis(Program(ep), [])(ep.graph_module)  # ran, with no inputs
    _rules(ep, [ObservedOverflowRule(65504 / 2)])
    assert not asked
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    found = _rules(ep, [ObservedOverflowRule(65504 / 2)])
    assert len(asked) == sum(n.op in ("placeholder", "call_function") for n in ep.graph.nodes)
    assert [name for name, rule in found.items() if rule] == ["mul"]  # fc(x) * 1e5


class _DividedEachCall(nn.Module):
    """A weight divided in place by ``divisor`` on every call, then multiplied by
    (transformers' RWKV divides its output weights by 2**0 each call)."""

    def __init__(self, divisor: float) -> None:
        super().__init__()
        self.divisor = divisor
        self.register_buffer("weight", torch.randn(8, 8))

    def forward(self, x):
        self.weight.div_(self.divisor)
        return x @ self.weight


@pytest.mark.parametrize("divisor, kept", [(1, False), (1.0, False), (1.5, True)])
def test_a_state_updated_by_a_neutral_scalar_does_not_accumulate(divisor, kept):
    """Divided by 1 on every call, the weight never changes: nothing rounds away, and it
    is stored 16-bit; divided by 1.5, it shrinks each call and stays fp32."""
    ep = fx16.cast_fp32_to_fp16(export(_DividedEachCall(divisor), torch.randn(4, 8)))
    weight = ep.state_dict["weight"]
    placeholder = next(n for n in ep.graph.nodes if n.op == "placeholder" and "weight" in n.name)
    reason = placeholder.meta[PRECISION].reason
    assert (reason is Reason.ACCUMULATING_STATE) is kept, reason
    assert weight.dtype == (torch.float32 if kept else torch.float16)
