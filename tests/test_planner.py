"""fx16.plan.planner: the whole graph's plan, built and printed before anything changes, and
applied as planned."""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import HealthCheck, given, settings

import fx16
from fx16 import meta
from fx16.decisions import PRECISION, Reason
from fx16.diagnosis import diagnose
from fx16.passes import InsertFP16CastsPass
from fx16.pipelines import fp16_stages, run_passes
from fx16.policy import PrecisionPolicy
from fx16.policy.options import Fp16Options
from fx16.program.subgraphs import nested_graph_modules
from fx16.report import report_of
from fx16.report.html import report_html
from fx16.report.saved import kept_decision
from fx16.testing.strategies import programs
from helpers import assert_same_state, check_program, export, state_snapshot
from models import AutocastRegions, Branches, BufferUpdate, GrowingLoop


class Mixed(torch.nn.Module):
    """An op kept fp32 by an observed overflow (its consumers read it in fp32), one
    the policy keeps fp32 (they read a 16-bit copy), a multi-output op, a 16-bit tail."""

    def forward(self, x):
        big = x * 1e5
        return big.tanh(), x.softmax(-1) + 1, torch.topk(x, 2).values * 2


def _ready(ep, options=None):
    """Every stage before the inserter; returns the inserter."""
    stages = fp16_stages(ep, options or Fp16Options())
    run_passes([*stages.before_decisions, *stages.decide, *stages.convert], ep.graph_module)
    return stages.find(InsertFP16CastsPass)


def _state(ep) -> list:
    """The graph code and every node's value and decision, bodies included."""
    return [
        (
            module.code,
            [(n.name, n.meta.get("val"), n.meta.get(PRECISION)) for n in module.graph.nodes],
        )
        for module in nested_graph_modules(ep.graph_module)
    ]


def _planned_then_applied(ep, options=None):
    inserter = _ready(ep, options)
    before = _state(ep)
    plan = inserter.plan(ep.graph_module)
    assert _state(ep) == before  # planning changes nothing, bodies included
    inserter(ep.graph_module)
    return plan


def _every_step(plan):
    for node, step in plan.steps.items():
        yield node, step
        for body in step.bodies:
            yield from _every_step(body)


def _applied_as_planned(plan) -> None:
    for node, step in _every_step(plan):
        if step.decision is not None:
            assert node.meta.get(PRECISION) == step.decision, node.name
            assert meta.planned(node) == step.planned(), node.name  # what the report reads
        if step.val is not None:
            assert _dtypes(node.meta.get("val")) == _dtypes(step.val), node.name


def _dtypes(val):
    if isinstance(val, torch.Tensor):
        return val.dtype
    if isinstance(val, (list, tuple)):
        return tuple(_dtypes(item) for item in val)
    return None


def test_the_plan_names_every_decision_and_cast_back_before_any_edit():
    ep = export(Mixed().eval(), torch.randn(4, 8))
    policy = PrecisionPolicy.custom(ops={"softmax": "fp32"})
    plan = _planned_then_applied(ep, Fp16Options(policy=policy))
    steps = {node.name: step for node, step in plan.steps.items()}
    overflow, kept = steps["mul"], steps["softmax"]
    assert overflow.choice.rule == "safety_rule"
    assert overflow.decision.reason == Reason.ACTIVATION_OVERFLOW
    assert overflow.cast_back is None and "beyond 16-bit" in overflow.cast_back_skipped
    assert steps["tanh"].decision.reason == Reason.FP32_INPUT  # reads mul in fp32
    assert steps["tanh"].decision.detail == "from mul: activation_overflow"
    assert steps["tanh"].cast_back is not None  # tanh fits: the output reads 16-bit
    assert kept.choice.rule == "policy_fp32" and kept.decision.reason == Reason.POLICY
    assert kept.cast_back.dtype == torch.float16  # add reads a 16-bit copy
    assert steps["add"].decision.dtype == torch.float16
    assert steps["getitem"].decision.dtype == torch.float16
    _applied_as_planned(plan)
    printed = str(plan)
    assert all(name in printed for name in steps)
    assert "no cast-back: observed" in printed and "consumers read a 16-bit copy" in printed
    check_program(ep)


def test_the_report_html_page_diagnosis_and_saved_program_read_the_applied_plan(tmp_path):
    x = torch.randn(4, 8)
    reference = export(Mixed().eval(), x)
    policy = PrecisionPolicy.custom(ops={"softmax": "fp32"})
    ep = fx16.cast_fp32_to_fp16(export(Mixed().eval(), x), policy=policy)
    nodes = {node.name: node for node in ep.graph_module.graph.nodes}
    assert meta.planned(nodes["mul"]).rule == "safety_rule"
    assert "beyond 16-bit" in meta.planned(nodes["mul"]).cast_back_skipped
    assert meta.planned(nodes["softmax"]).cast_back  # add reads a 16-bit copy
    rows = {row.node: row for row in report_of(ep).rows}
    assert (rows["mul"].rule, rows["mul"].chosen_by) == ("activation_overflow", "safety_rule")
    assert (rows["softmax"].rule, rows["softmax"].chosen_by) == ("policy", "policy_fp32")
    assert rows["tanh"].chosen_by == "fp32_input" and "[chosen by" not in rows["tanh"].why()
    table = report_of(ep).table()
    assert "[chosen by safety_rule]" in table and "[chosen by policy_fp32]" in table
    assert "[chosen by safety_rule]" in report_html(report_of(ep), "Mixed")
    said = [value.decision for value in diagnose(reference, ep, [(x,)]).values]
    assert any("chosen by safety_rule; no cast-back: observed" in text for text in said)
    torch.export.save(ep, tmp_path / "cast.pt2")
    loaded = torch.export.load(tmp_path / "cast.pt2")
    kept = [kept_decision(node) for node in loaded.graph_module.graph.nodes]
    assert any("chosen by policy_fp32; consumers read a 16-bit copy" in text for text in kept)


def test_a_decision_is_said_the_same_each_time_and_only_shared_ones_are_remembered():
    """``explained`` keeps the text of the shared (decision, planned step) pairs most nodes
    carry: the same text on every call, and nothing kept of a decision with a detail."""
    import fx16.plan.steps

    x = torch.randn(4, 8)
    ep = fx16.cast_fp32_to_fp16(export(Mixed().eval(), x))
    first = {node.name: fx16.plan.steps.explained(node) for node in ep.graph_module.graph.nodes}
    second = {node.name: fx16.plan.steps.explained(node) for node in ep.graph_module.graph.nodes}
    assert first == second and any(first.values())
    assert all(not decision.detail for decision, _, _ in fx16.plan.steps._EXPLAINED.values())
    assert first["mul"].startswith("activation_overflow: observed")  # its detail, said


@pytest.mark.parametrize(
    "model, x, planned",
    [
        (Branches(), torch.randn(2, 4), "bodies"),
        (GrowingLoop(), torch.randn(2, 8), "bodies"),
        (AutocastRegions(), torch.randn(2, 8), Reason.AUTOCAST_REGION),
    ],
)
def test_bodies_have_plans_of_their_own_applied_as_planned(model, x, planned):
    torch.manual_seed(0)
    ep = export(model.eval(), x)
    plan = _planned_then_applied(ep)
    steps = list(plan.steps.values())
    if planned == "bodies":
        assert any(step.bodies and step.bodies[0].steps for step in steps)
        assert "    " in str(plan)  # a body's steps, indented under its op
        body_rows = [row for row in report_of(ep).rows if "." in row.node]  # body.node
        assert body_rows and all(row.chosen_by for row in body_rows if row.op != "placeholder")
    else:
        assert any(step.decision is not None and step.decision.reason == planned for step in steps)
    _applied_as_planned(plan)
    check_program(ep)


class CastInBody(torch.nn.Module):
    """The model's own casts to fp16 inside a ``torch.no_grad()`` body: of the input and
    of a weight fx16 makes fp16 anyway."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        with torch.no_grad():
            y = (x.half() @ self.w.half().t()).relu()
        return y.float() + 1


def test_a_cast_to_the_dtype_a_value_already_has_carries_its_decision_inside_a_body():
    """Inside a set_grad_enabled body, the model's ``w.half()`` of a weight fx16 narrowed
    is a no-op that carries the weight's decision: the ops after it read a 16-bit value
    (the matmul stays 16-bit), as they will once cleanup drops the cast, so casting
    twice equals casting once."""
    torch.manual_seed(0)
    ep = export(CastInBody().eval(), torch.randn(4, 8))
    plan = _planned_then_applied(ep)
    (region,) = [step for step in plan.steps.values() if step.bodies]
    body = {node.name: step for node, step in region.bodies[0].steps.items()}
    weight = next(n for n in ep.graph_module.graph.nodes if n.name == "p_w")
    assert body["to_1"].choice is None and body["to_1"].decision == weight.meta[PRECISION]
    assert body["matmul"].decision.dtype == torch.float16
    ep = fx16.cast_fp32_to_fp16(export(CastInBody().eval(), torch.randn(4, 8)))
    once = state_snapshot(ep)
    fx16.cast_fp32_to_fp16(ep)
    assert_same_state(once, state_snapshot(ep))


def test_the_plan_names_the_dtypes_outputs_keep():
    """A buffer written in place returns in the dtype it is stored in (16-bit), and
    keep_io_types keeps the user output fp32: the plan lists both before the walk, and
    apply gives them back."""
    ep = export(BufferUpdate(accumulate=False).eval(), torch.randn(3, 4), decompose=True)
    plan = _planned_then_applied(ep, Fp16Options(keep_io_types=True))
    assert plan.output_dtypes == {0: torch.float16, 1: torch.float32}
    assert "keep their dtypes (0: float16, 1: float32)" in str(plan)
    outputs = ep.graph_module.graph.output_node().args[0]
    assert [out.meta["val"].dtype for out in outputs] == [torch.float16, torch.float32]
    check_program(ep)


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_are_planned_without_a_change_and_applied_as_planned(case):
    """On programs of the fuzzer's whole menu (higher-order ops, custom ops, decomposed
    casts, in-place ops): building the plan leaves the program as it was, every node
    then records the decision and dtypes the plan gave it, and the result runs."""
    ep = case.export()
    plan = _planned_then_applied(ep)
    _applied_as_planned(plan)
    check_program(ep)


class HalfRoundTrip(torch.nn.Module):
    """The model's own ``x.half().float()``, read by a kept fp32 region (amax) and by a
    Linear: the autocast preset keeps the region and its weights fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = x.half().float()
        return h.amax(-1, keepdim=True) - h, self.linear(h)


def test_an_fp32_op_past_a_kept_region_reads_the_fp32_value_not_its_16_bit_source():
    """Consumers outside a kept region read the 16-bit source the region's opening cast
    up, as exported; one that computes in fp32 after all (here: its weights stay fp32)
    reads the opening's fp32 value. Found by the long fuzz: the Linear read the fp16
    source beside fp32 weights and failed when run ("mat1 and mat2 must have the same
    dtype")."""
    torch.manual_seed(0)
    model, x = HalfRoundTrip().eval(), torch.randn(3, 4)
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy="autocast")
    check_program(ep)
    linear = next(n for n in ep.graph.nodes if n.target is torch.ops.aten.linear.default)
    dtypes = {arg.meta["val"].dtype for arg in linear.args if isinstance(arg, torch.fx.Node)}
    assert len(dtypes) == 1
    with torch.no_grad():
        outputs = ep.module()(*fx16.inputs_for(ep, x)[0])
    torch.testing.assert_close(outputs[1].float(), model(x)[1], rtol=1e-2, atol=1e-2)
