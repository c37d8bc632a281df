"""LeanInterpreter: runs a graph like torch.fx.Interpreter, minus the traceback bookkeeping."""

import pytest
import torch

from fx16.interpreter import LeanInterpreter
from fx16.program import Program
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
