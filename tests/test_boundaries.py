"""Facts cross the boundaries of higher-order ops: every body kind x every analysis.

Each scenario computes one thing inside a body of each kind - set_grad_enabled
(``torch.no_grad()``), autocast, cond, while_loop, map, invoke_subgraph (a
``nested_compile_region`` called twice, strict export) - with its operands coming
from outside, and checks that the analysis's fact holds on both sides.
"""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.while_loop import while_loop

import fx16
from fx16.analysis import (
    CalibrationAnalysis,
    ConditioningAnalysis,
    ExplicitFp32Analysis,
    UnderflowAnalysis,
    UnsafeIndexAnalysis,
    ValueRangeAnalysis,
)
from fx16.analysis.float_range import FloatRanges
from fx16.decisions import PRECISION, Reason
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from fx16.program.subgraphs import nested_graph_modules
from fx16.testing import programs
from helpers import check_program, fp64_reference, max_error, run

KINDS = ["set_grad_enabled", "autocast", "cond", "while_loop", "map", "invoke_subgraph"]
POSITIONS = {"positions": (0, 2047)}


def angles(y, positions, inv_freq):
    """A rotary table added to y: sin/cos of positions up to 2047 times inv_freq."""
    a = positions[:, None].float() * inv_freq[None, :]
    return y + torch.cat([a.sin(), a.cos()], -1)


def gather_rows(y, ids, table):
    """Rows of ``table`` picked by ``ids`` (an index inside the body)."""
    return y + table[ids]


def entropy_terms(y, p):
    """p log p, with p a sharp softmax computed outside."""
    return y + p * p.log()


def variance(y, h):
    """The mean of squares of an fp32 value the model cast outside (an RMSNorm's)."""
    return y + h.pow(2).mean(-1, keepdim=True)


REGIONS = {
    f: torch.compiler.nested_compile_region(f)
    for f in (angles, gather_rows, entropy_terms, variance)
}


def in_body(kind, fn, y, *others):
    """``fn(y, *others)`` computed inside a body of ``kind``."""
    if kind == "set_grad_enabled":
        with torch.no_grad():
            return fn(y, *others)
    if kind == "autocast":
        with torch.autocast("cpu", enabled=False):
            return fn(y, *others)
    if kind == "cond":
        return torch.cond(y.sum() > -1e30, fn, lambda *a: fn(*a) * 0, (y, *others))
    if kind == "while_loop":  # y is carried; the others are the loop's additional inputs

        def condition(step, value):
            return step < 1

        def body(step, value):
            return step + 1, fn(value, *others)

        return while_loop(condition, body, (torch.tensor(0), y))[1]
    if kind == "map":
        return hop_map(lambda value, *rest: fn(value, *rest), y[None], *others)[0]
    region = REGIONS[fn]  # invoke_subgraph: a region called twice shares one body
    return region(region(y, *others), *others)


class Scenario(torch.nn.Module):
    """y -> fn inside a body of ``kind`` -> a linear, with state and inputs from outside."""

    def __init__(self, kind, fn):
        super().__init__()
        self.kind, self.fn = kind, fn
        self.register_buffer("inv_freq", 10000.0 ** (-torch.arange(0, 16, 2).float() / 16))
        self.table = torch.nn.Parameter(torch.randn(32, 16))
        self.logits = torch.nn.Linear(16, 16)
        with torch.no_grad():
            self.logits.weight.mul_(8.0)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, y, positions):
        if self.fn is angles:
            operands = (positions, self.inv_freq)
        elif self.fn is gather_rows:
            operands = (positions % 32, self.table)
        elif self.fn is entropy_terms:
            operands = (self.logits(y).softmax(-1),)
        else:
            operands = (y.float() * 1.0,)
        return self.fc(in_body(self.kind, self.fn, y, *operands))


def _export(kind, fn):
    torch.manual_seed(0)
    model = Scenario(kind, fn).eval()
    if kind == "invoke_subgraph":  # export inlines a region whose operands require grad
        model.requires_grad_(False)
    args = (torch.randn(4, 16), torch.arange(4))
    return model, torch.export.export(model, args, strict=kind == "invoke_subgraph")


def _outer(ep, name):
    return next(n for n in ep.graph_module.graph.nodes if n.name == name)


def _inner(ep, predicate):
    """The nodes of the bodies (not the root graph) for which ``predicate`` holds."""
    bodies = nested_graph_modules(ep.graph_module)[1:]
    assert bodies, "the scenario has no body"
    return [n for body in bodies for n in body.graph.nodes if predicate(n)]


def _crossing(ep, outer_name):
    """The body placeholders that hold the outer node's value."""
    boundaries = Boundaries(ep.graph_module)
    sinks = boundaries.crossing_sinks(_outer(ep, outer_name))
    assert sinks and all(sink.op == "placeholder" for sink in sinks)
    return sinks


@pytest.mark.parametrize("kind", KINDS)
def test_links_pair_operands_with_placeholders_and_outputs_with_results(kind):
    """operand -> body placeholder; body output -> the op's result (getitem)."""
    _, ep = _export(kind, angles)
    boundaries = Boundaries(ep.graph_module)
    for placeholder in _crossing(ep, "b_inv_freq"):  # both branches, or two call sites
        assert set(boundaries.crossing_sources(placeholder)) == {_outer(ep, "b_inv_freq")}
        assert set(boundaries.inputs(placeholder)) == {_outer(ep, "b_inv_freq")}
    results = [n for n in ep.graph_module.graph.nodes if boundaries.crossing_sources(n)]
    assert results and all(n.target.__name__ == "getitem" for n in results)
    inner_outputs = {s for r in results for s in boundaries.crossing_sources(r)}
    assert any(node.graph is not ep.graph_module.graph for node in inner_outputs)


def test_a_loop_carries_its_values_both_ways():
    """while_loop: placeholder i <- operand i and <- the body's output i; result i <- both."""
    _, ep = _export("while_loop", angles)
    boundaries = Boundaries(ep.graph_module)
    loop = next(
        n for n in ep.graph_module.graph.nodes if n.target is torch.ops.higher_order.while_loop
    )
    body = getattr(ep.graph_module, loop.args[1].target)
    carried_y = body.graph.find_nodes(op="placeholder")[1]
    sources = boundaries.crossing_sources(carried_y)
    assert loop.args[2][1] in sources  # the operand, on the first iteration
    assert body.graph.output_node().args[0][1] in sources  # the body's output, after


@pytest.mark.parametrize("kind", KINDS)
def test_calibration_observes_bodies_and_fills_placeholders_no_run_reached(kind):
    _, ep = _export(kind, angles)
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    sins = _inner(ep, lambda n: n.target == torch.ops.aten.sin.default)
    assert any(CalibrationAnalysis.INTERVAL_KEY in n.meta for n in sins)  # cond: one branch
    for placeholder in _crossing(ep, "b_inv_freq"):
        assert placeholder.meta[CalibrationAnalysis.META_KEY] == pytest.approx(1.0)


def test_a_branch_no_run_took_has_its_operands_observations():
    model, ep = _export("cond", angles)
    cond = next(n for n in ep.graph_module.graph.nodes if n.target is torch.ops.higher_order.cond)
    untaken = getattr(ep.graph_module, cond.args[2].target)  # the predicate is always true
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    ops = [n for n in untaken.graph.nodes if n.op == "call_function"]
    assert not any(CalibrationAnalysis.META_KEY in n.meta for n in ops)
    placeholders = untaken.graph.find_nodes(op="placeholder")
    assert [p.meta.get(CalibrationAnalysis.INTERVAL_KEY) for p in placeholders] == [
        a.meta.get(CalibrationAnalysis.INTERVAL_KEY) for a in cond.args[3]
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_integer_and_float_ranges_enter_bodies(kind):
    """The declared positions range and the inv_freq buffer's range hold inside."""
    _, ep = _export(kind, angles)
    program = Program(ep)
    ValueRangeAnalysis(program, POSITIONS)(ep.graph_module)
    ranges = FloatRanges(program)
    for placeholder in _crossing(ep, "positions"):
        found = placeholder.meta[ValueRangeAnalysis.META_KEY]
        assert (found.low, found.high) == (0, 2047)
    for placeholder in _crossing(ep, "b_inv_freq"):
        proven = ranges.of(placeholder)
        assert (proven.low, proven.high) == pytest.approx((10000.0 ** (-14 / 16), 1.0))


@pytest.mark.parametrize("kind", KINDS)
def test_a_mark_made_inside_holds_on_the_operand_outside(kind):
    """Conditioning marks sin(positions * inv_freq) inside; inv_freq outside is marked,
    stays fp32 after the cast, and the table is accurate at position 2000."""
    model, ep = _export(kind, angles)
    program = Program(ep)
    CalibrationAnalysis(program)(ep.graph_module)
    ValueRangeAnalysis(program, POSITIONS)(ep.graph_module)
    ConditioningAnalysis(program)(ep.graph_module)
    assert "feeds" in _outer(ep, "b_inv_freq").meta[ConditioningAnalysis.META_KEY]
    _, ep = _export(kind, angles)
    fx16.cast_fp32_to_fp16(ep, input_ranges=POSITIONS)
    check_program(ep)
    inv_freq = _outer(ep, "b_inv_freq")
    assert inv_freq.meta[PRECISION].reason == Reason.ILL_CONDITIONED
    assert inv_freq.meta["val"].dtype == torch.float32
    args = (torch.randn(4, 16), torch.arange(1996, 2000))
    assert max_error(fp64_reference(model, *args), run(ep, *args)) < 3e-3


@pytest.mark.parametrize("kind", KINDS)
def test_an_index_inside_marks_its_operand_outside(kind):
    _, ep = _export(kind, gather_rows)
    UnsafeIndexAnalysis()(ep.graph_module)
    remainder = next(
        n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.remainder.Scalar
    )
    assert remainder.meta[UnsafeIndexAnalysis.META_KEY]
    assert _outer(ep, "positions").meta[UnsafeIndexAnalysis.META_KEY]
    assert not _outer(ep, "y").meta[UnsafeIndexAnalysis.META_KEY]


@pytest.mark.parametrize("kind", KINDS)
def test_an_underflow_inside_keeps_the_softmax_outside(kind):
    """log(p) inside, p = a sharp softmax outside: p's smallest values flush in fp16."""
    _, ep = _export(kind, entropy_terms)
    program = Program(ep)
    CalibrationAnalysis(program)(ep.graph_module)
    ValueRangeAnalysis(program)(ep.graph_module)
    UnderflowAnalysis(program)(ep.graph_module)
    logs = _inner(ep, lambda n: n.target == torch.ops.aten.log.default)
    assert all("singular at zero" in log.meta[UnderflowAnalysis.META_KEY] for log in logs)
    softmax = next(n for n in ep.graph_module.graph.nodes if "softmax" in str(n.target))
    assert softmax.meta[UnderflowAnalysis.META_KEY] == f"feeds {logs[0].name}, kept in fp32"


@pytest.mark.parametrize("kind", KINDS)
def test_an_island_opened_outside_reaches_into_the_body(kind):
    """h = y.float() outside, its mean of squares inside: one region; with
    explicit_fp32='keep' the squares inside compute in fp32."""
    _, ep = _export(kind, variance)
    program = Program(ep)
    CalibrationAnalysis(program)(ep.graph_module)
    ValueRangeAnalysis(program)(ep.graph_module)
    ExplicitFp32Analysis(program, fx16.PrecisionPolicy.default(explicit_fp32="keep"))(
        ep.graph_module
    )
    (verdict,) = ep.graph_module.meta[ExplicitFp32Analysis.META_KEY]
    assert verdict.keep and verdict.opening == "to"
    _, ep = _export(kind, variance)
    fx16.cast_fp32_to_fp16(ep, explicit_fp32="keep")
    check_program(ep)
    powers = _inner(ep, lambda n: n.target == torch.ops.aten.pow.Tensor_Scalar)
    if kind != "autocast":  # a torch.autocast(enabled=False) body runs as exported, in fp32
        assert all(n.meta[PRECISION].reason == Reason.EXPLICIT_FP32 for n in powers)
    assert all(n.meta["val"].dtype == torch.float32 for n in powers)


@settings(max_examples=examples(12), deadline=None)
@given(programs())
def test_property_links_are_two_way_and_every_body_placeholder_is_fed(case):
    """Random programs (cond, while_loop, map, autocast): each link is known from both
    ends, every body placeholder has a source outside its body, and what calibration saw
    a placeholder hold lies within what its operands held (outside a loop)."""
    ep = case.export()
    CalibrationAnalysis(Program(ep))(ep.graph_module)
    boundaries = Boundaries(ep.graph_module)
    for module in boundaries.graph_modules[1:]:
        for placeholder in module.graph.find_nodes(op="placeholder"):
            sources = boundaries.crossing_sources(placeholder)
            assert sources, placeholder.name
            assert all(placeholder in boundaries.crossing_sinks(s) for s in sources)
            seen = placeholder.meta.get(CalibrationAnalysis.INTERVAL_KEY)
            outside = [s.meta.get(CalibrationAnalysis.INTERVAL_KEY) for s in sources]
            looped = any(s.graph is module.graph for s in sources)  # carried by a loop
            if seen is not None and None not in outside and not looped:
                low, high = min(o[0] for o in outside), max(o[1] for o in outside)
                assert low - 1e-6 * abs(low) <= seen[0] and seen[1] <= high + 1e-6 * abs(high)
