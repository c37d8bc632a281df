"""fx16.analysis.facts: one table of facts per graph, shared by the analyses, dropped on rewrite."""

import torch

import fx16
from fx16.analysis import ValueRangeAnalysis
from fx16.analysis.facts import Facts
from fx16.pipelines import fp16_stages, run_passes
from fx16.policy.options import Fp16Options
from fx16.program import Program
from helpers import export
from models import MLP, Branches


def test_the_analyses_share_one_table_and_a_rewrite_drops_it():
    ep = export(Branches(), torch.randn(2, 4))
    graph_module = ep.graph_module
    facts = Facts.of(graph_module)
    assert Facts.of(graph_module) is facts
    assert facts.boundaries is facts.boundaries  # computed once
    assert len(facts.graph_modules) == 3  # the program and cond's two branches
    stages = fp16_stages(ep, Fp16Options())
    run_passes(stages.before_decisions, graph_module)
    assert Facts.of(graph_module) is facts  # analyses read and write meta only
    run_passes(stages.from_decisions, graph_module)
    assert Facts.of(graph_module) is not facts  # the inserter added casts
    assert fx16.cast_fp32_to_fp16(ep) is ep  # and the next cast starts from the new graph


def test_a_rewrite_that_forgets_to_invalidate_is_caught_by_the_node_count():
    ep = export(MLP(), torch.randn(2, 8))
    graph = ep.graph_module.graph
    facts = Facts.of(ep.graph_module)
    positions = facts.positions
    first = next(iter(graph.find_nodes(op="placeholder")))
    with graph.inserting_after(first):
        graph.call_function(torch.ops.aten.relu.default, (first,))  # a foreign pass's node
    fresh = Facts.of(ep.graph_module)
    assert fresh is not facts and len(fresh.positions) == len(positions) + 1


def test_float_ranges_are_shared_until_the_integer_ranges_they_start_from_arrive():
    ep = export(MLP(), torch.randn(2, 8))
    program = Program.of(ep)
    facts = Facts.of(ep.graph_module)
    before = facts.float_ranges(program)
    assert facts.float_ranges(program) is before
    ValueRangeAnalysis(program)(ep.graph_module)
    after = facts.float_ranges(program)
    assert after is not before and facts.float_ranges(program) is after


def test_a_derived_fact_is_computed_once_per_table():
    """``Facts.derived`` answers from the table until the graph changes: the fp32 regions
    the rewrites and ExplicitFp32Analysis both read are found once, and a new graph
    finds them again."""
    ep = export(MLP(), torch.randn(2, 8))
    facts, calls = Facts.of(ep.graph_module), []

    def count():
        calls.append(True)
        return len(calls)

    assert facts.derived("count", count) == facts.derived("count", count) == 1
    Facts.invalidate(ep.graph_module)
    assert Facts.of(ep.graph_module).derived("count", count) == 2
