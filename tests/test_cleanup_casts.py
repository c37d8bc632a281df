"""CleanupCastsPass: the rules together, run to a fixed point."""

import pytest
import torch

from fx16.passes import CleanupCastsPass
from fx16.program import Program
from helpers import casts, check_program, eager, export, run
from models import Branching, SameDtypeCast, TwoCasts, Widening

aten = torch.ops.aten
HALF = torch.randn(2, 3).half()


@pytest.mark.parametrize("model", [SameDtypeCast(), Widening(), Branching(), TwoCasts()])
def test_driver_reaches_a_fixed_point(model):
    ep = export(model, HALF)
    expected = eager(model, HALF)
    CleanupCastsPass(Program(ep))(ep.graph_module)
    ep.graph_module.recompile()
    check_program(ep)
    assert not CleanupCastsPass(Program(ep))(ep.graph_module).modified
    for got, want in zip(run(ep, HALF), expected if isinstance(expected, tuple) else (expected,)):
        torch.testing.assert_close(got, want)


def test_driver_removes_round_trips_entirely():
    ep = export(Widening(), HALF)
    CleanupCastsPass(Program(ep))(ep.graph_module)
    assert casts(ep) == []
