"""UserReachabilityAnalysis: which nodes depend on a user input."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fx16.analysis import UserReachabilityAnalysis
from fx16.program import Program
from helpers import export, targets
from models import PositionsAndMask

KEY = UserReachabilityAnalysis.META_KEY
aten = torch.ops.aten


class ConstantBranch(torch.nn.Module):
    """argmax(weight) + 1 depends on no input; x + that sum does."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        table = self.weight.argmax(-1) + 1
        return x + table


def _analyse(ep):
    result = UserReachabilityAnalysis(Program(ep))(ep.graph_module)
    assert not result.modified
    return {node.name: node.meta[KEY] for node in ep.graph_module.graph.nodes}


def test_constant_subgraph_is_not_reachable():
    """p_weight -> argmax -> add(1)  (not reachable);  x -> add(x, table)  (reachable)."""
    ep = export(ConstantBranch(), torch.arange(4))
    code = ep.graph_module.code
    found = _analyse(ep)
    assert ep.graph_module.code == code
    assert found == {
        "p_weight": False,
        "x": True,
        "argmax": False,
        "add": False,
        "add_1": True,
        "output": True,
    }


def test_shapes_of_dynamic_inputs_are_reachable():
    length = torch.export.Dim("length", max=64)
    args = (torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.bool))
    ep = export(PositionsAndMask(), *args, dynamic_shapes=({1: length}, {1: length}))
    found = _analyse(ep)
    assert found["sym_size_int_1"] and found["arange"]
    assert not found["p_embed_weight"]


def test_static_arange_is_constant_foldable():
    args = (torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.bool))
    ep = export(PositionsAndMask(), *args)
    assert targets(ep)[aten.arange.default] == 1
    assert not _analyse(ep)["arange"]


def _changes_with_the_input(ep, first, second) -> dict[str, bool]:
    """Which nodes' values differ between runs on two user inputs (every node of the
    graph, run by torch.fx's own Interpreter): the definition of depending on them."""
    runs = []
    for x in (first, second):
        interpreter = torch.fx.Interpreter(ep.graph_module, garbage_collect_values=False)
        interpreter.run(*Program(ep).graph_inputs((x,)))
        runs.append(interpreter.env)
    return {
        node.name: not torch.equal(runs[0][node], runs[1][node])
        for node in ep.graph_module.graph.nodes
        if node.op != "output"
    }


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 6))
def test_reachable_is_exactly_what_changes_with_the_user_input(depth):
    """A chain mixing a user input with a buffer's constant computations: a node is marked
    reachable exactly when its value changes as the input does (x, then x + 1: every
    op here is injective in x), which runs the graph instead of reading the analysis."""

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("offset", torch.arange(3))

        def forward(self, x):
            constant = self.offset
            for _ in range(depth):
                constant = constant * 2
                x = x + constant
            return x

    x = torch.arange(3)
    ep = export(Chain(), x)
    found = _analyse(ep)
    changes = _changes_with_the_input(ep, x, x + 1)
    assert {name: found[name] for name in changes} == changes
    assert not all(changes.values())  # the buffer's chain does not change: both kinds drawn


def test_every_pass_takes_the_exported_program_as_the_cast_functions_do():
    """UserReachabilityAnalysis(ep), not only UserReachabilityAnalysis(Program(ep))."""
    ep = export(ConstantBranch(), torch.arange(4))
    by_program = _analyse(ep)
    UserReachabilityAnalysis(ep)(ep.graph_module)
    assert {n.name: n.meta[KEY] for n in ep.graph_module.graph.nodes} == by_program
