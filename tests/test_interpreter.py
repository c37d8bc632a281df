"""LeanInterpreter: runs a graph like torch.fx.Interpreter, minus the traceback bookkeeping;
BodyInterpreter and program_values: the bodies of higher-order ops node by node."""

import pytest
import torch
from test_boundaries import KINDS, _export, variance

from fx16.program import Program
from fx16.program.interpreter import BodyInterpreter, LeanInterpreter, last_uses
from fx16.program.values import program_values
from helpers import export
from models import MLP, Branches, ScaleShiftChain


@pytest.mark.parametrize("model, shape", [(MLP(), (3, 8)), (Branches(), (2, 4))])
def test_runs_like_the_graph_module(model, shape):
    torch.manual_seed(0)
    ep = export(model.eval(), torch.randn(*shape))
    inputs = Program(ep).graph_inputs((torch.randn(*shape),))
    with torch.no_grad():
        expected = ep.graph_module(*inputs)
        got = LeanInterpreter(ep.graph_module).run(*inputs)
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


def test_a_failing_node_is_named():
    ep = export(MLP().eval(), torch.randn(3, 8))
    inputs = Program(ep).graph_inputs((torch.randn(3, 5),))  # the wrong width
    with pytest.raises(RuntimeError, match="While executing %linear"):
        LeanInterpreter(ep.graph_module).run(*inputs)


class _Watcher(LeanInterpreter):
    """Records how many values the run holds after each node."""

    def __init__(self, graph_module, fail_at=None):
        super().__init__(graph_module)
        self.held, self.ran, self.fail_at = [], [], fail_at

    def run_node(self, node):
        if node.name == self.fail_at:
            raise KeyError("no such thing")
        self.ran.append(node.name)
        self.held.append(len(self.env))
        return super().run_node(node)


def test_each_value_is_freed_after_its_last_use_and_a_given_value_is_not_recomputed():
    ep = export(ScaleShiftChain(20, 1.5, 1.0), torch.randn(4))
    x = torch.randn(4)
    with torch.no_grad():
        expected = ep.graph_module(x)
        watcher = _Watcher(ep.graph_module)
        (got,) = watcher.run(x)
        assert torch.equal(got, expected[0])
        assert len(watcher.ran) == len(ep.graph.nodes) and max(watcher.held) <= 2

        first = next(n for n in ep.graph.nodes if n.op == "call_function")
        given = _Watcher(ep.graph_module)
        (partial,) = given.run(x, initial_env={first: torch.zeros(4)})
    assert first.name not in given.ran
    y = torch.zeros(4) + 1.0  # the first x * 1.5 is given as zeros
    for _ in range(19):
        y = y * 1.5 + 1.0
    assert torch.equal(partial, y)


def test_last_uses_given_once_serve_every_run_as_torchs_own_would():
    ep = export(MLP().eval(), torch.randn(3, 8))
    freed = last_uses(ep.graph)
    assert freed == torch.fx.Interpreter(ep.graph_module).user_to_last_uses
    inputs = Program(ep).graph_inputs((torch.randn(3, 8),))
    with torch.no_grad():
        expected = ep.graph_module(*inputs)
        for _ in range(2):
            interpreter = LeanInterpreter(ep.graph_module, last_uses=freed)
            assert interpreter.user_to_last_uses is freed
            got = interpreter.run(*inputs)
            assert all(torch.equal(want, have) for want, have in zip(expected, got))
            assert list(interpreter.env) == [ep.graph.output_node()]  # the rest was freed


def test_a_key_error_inside_a_node_is_a_runtime_error_naming_it():
    ep = export(ScaleShiftChain(20, 1.5, 1.0), torch.randn(4))
    second = [n for n in ep.graph.nodes if n.op == "call_function"][1].name
    with pytest.raises(RuntimeError, match=f"(?s)no such thing.*While executing %{second}"):
        _Watcher(ep.graph_module, fail_at=second).run(torch.randn(4))


class _Recorder(BodyInterpreter):
    """Records the graph of every node it runs (bodies included)."""

    def __init__(self, graph_module, graphs):
        super().__init__(graph_module)
        self.graphs = graphs

    def inside(self, body):
        return _Recorder(body, self.graphs)

    def run_node(self, node):
        self.graphs.add(id(node.graph))
        return super().run_node(node)


@pytest.mark.parametrize("kind", KINDS)
def test_bodies_run_node_by_node_in_both_interpreters(kind):
    """BodyInterpreter and program_values (the lockstep generator) share one statement
    of how each higher-order op runs its bodies: both give the graph module's outputs,
    BodyInterpreter runs every kind's body node by node, program_values runs cond,
    while_loop, map and invoke_subgraph bodies node by node (ids prefixed by the body)
    and autocast / set_grad_enabled regions whole."""
    _, ep = _export(kind, variance)
    program = Program(ep)
    inputs = program.graph_inputs((torch.randn(4, 16), torch.arange(4)))
    with torch.no_grad():
        expected = ep.graph_module(*inputs)
        graphs = set()
        got = _Recorder(ep.graph_module, graphs).run(*inputs)
        values = list(program_values(program, inputs))
    assert all(torch.equal(want, have) for want, have in zip(expected, got))
    assert len(graphs) > 1  # a body's nodes ran one by one
    outputs = program.output_node().args[0]
    streamed = {node: value for _, node, value in values}
    assert all(torch.equal(streamed[out], want) for out, want in zip(outputs, expected))
    in_bodies = [key for key, node, _ in values if node.graph is not ep.graph_module.graph]
    if kind in ("autocast", "set_grad_enabled"):
        assert not in_bodies
    else:
        assert in_bodies and all("." in identity for identity, _ in in_bodies)
