"""LeanInterpreter: runs a graph like torch.fx.Interpreter, minus the traceback bookkeeping;
BodyInterpreter and program_values: the bodies of higher-order ops node by node."""

import pytest
import torch
from test_boundaries import KINDS, _export, variance

from fx16.interpreter import BodyInterpreter, LeanInterpreter
from fx16.program import Program
from fx16.program_values import program_values
from helpers import export
from models import MLP, Branches


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
