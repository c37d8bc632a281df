"""CastableInt16Analysis: the integer nodes connected to an int16 computation."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fx16.analysis import CastableInt16Analysis, UnsafeIndexAnalysis, UserReachabilityAnalysis
from fx16.errors import PreconditionError
from fx16.ops.int_ops import INT16_COMPUTE_OPS
from fx16.program import Program
from fx16.testing.strategies import integer_cases
from helpers import export
from models import BucketHash, GatherComputedIndex, Int32Arithmetic, PositionsAndMask

KEY = CastableInt16Analysis.META_KEY


def _analyse(ep):
    program = Program(ep)
    for analysis in (
        UserReachabilityAnalysis(program),
        UnsafeIndexAnalysis(),
        CastableInt16Analysis(),
    ):
        assert not analysis(ep.graph_module).modified
    return {node.name for node in ep.graph_module.graph.nodes if node.meta[KEY]}


def test_needs_its_inputs_analysed_first():
    ep = export(BucketHash(), torch.arange(5))
    for analysis in (CastableInt16Analysis(), CastableInt16Analysis(Program(ep))):
        with pytest.raises(PreconditionError, match="UnsafeIndexAnalysis, UserReachabilityAnal"):
            analysis(ep.graph_module)
    assert not any(KEY in node.meta for node in ep.graph_module.graph.nodes)
    assert _analyse(ep) == {"ids", "add", "remainder"}


def test_seeds_grow_to_producers_and_consumers():
    """a, b -> add -> ... ; (a - b) * (a + b): every node joins, inputs included."""
    args = (torch.arange(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32))
    assert _analyse(export(Int32Arithmetic(), *args)) == {"a", "b", "add", "sub", "add_1", "mul"}


def test_scalar_operand_ops_never_join():
    """ids * 1000 (scalar) stays out; add(mul, ids) seeds; remainder joins through it."""
    assert _analyse(export(BucketHash(), torch.arange(5))) == {"ids", "add", "remainder"}


def test_growth_stops_at_index_paths_and_constants():
    args = (torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.bool))
    castable = _analyse(export(PositionsAndMask(), *args))
    assert castable == {"remainder", "add_2", "mul"}  # ids itself feeds the embedding


def test_gather_index_path_is_excluded():
    castable = _analyse(
        export(GatherComputedIndex(), torch.randn(2, 5), torch.randint(0, 5, (2, 3)))
    )
    assert castable == {"add_1"}


def _connected_to_a_seed(ep) -> set[str]:
    """The castable set by its definition, computed apart from the analysis: the
    eligible nodes (wide integers that depend on a user input, flow into no index and
    are no add/sub/mul with a scalar), grown to a fixed point from the seeds (eligible
    add/sub/mul of wide integers) through producer and consumer edges."""
    nodes = list(ep.graph_module.graph.nodes)

    def eligible(node):
        val = node.meta.get("val")
        return (
            node.op in ("placeholder", "call_function")
            and isinstance(val, torch.Tensor)
            and val.dtype in (torch.int32, torch.int64)
            and node.meta[UserReachabilityAnalysis.META_KEY]
            and not node.meta[UnsafeIndexAnalysis.META_KEY]
            and not (node.target in INT16_COMPUTE_OPS and _scalar_operand(node))
        )

    found = {
        n
        for n in nodes
        if n.target in INT16_COMPUTE_OPS
        and eligible(n)
        and all(a.meta["val"].dtype in (torch.int32, torch.int64) for a in n.all_input_nodes)
    }
    while True:
        grown = {
            n
            for n in nodes
            if n not in found and eligible(n) and (set(n.all_input_nodes) | set(n.users)) & found
        }
        if not grown:
            return {n.name for n in found}
        found |= grown


def _scalar_operand(node) -> bool:
    return any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in node.args)


def test_castable_nodes_are_exactly_the_eligible_ones_joined_to_a_seed():
    """Random integer programs: the analysis' set equals the definition's fixed point,
    and it is not empty in at least half of the examples (counted)."""
    nonempty = []

    @settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(integer_cases())
    def check(case):
        model, args, _, _ = case
        ep = export(model, *args)
        castable = _analyse(ep)
        assert castable == _connected_to_a_seed(ep)
        nonempty.append(bool(castable))

    check()
    assert sum(nonempty) >= len(nonempty) / 2, f"non-empty in {sum(nonempty)} of {len(nonempty)}"
