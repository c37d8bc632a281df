"""CleanupCastsPass: the rules together, run to a fixed point."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fx16.passes import CleanupCastsPass
from fx16.program import Program
from fx16.program.casts import is_cast
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


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]


class CastChain(torch.nn.Module):
    def __init__(self, dtypes):
        super().__init__()
        self.dtypes = dtypes

    def forward(self, x):
        for dtype in self.dtypes:
            x = x.to(dtype)
        return x * 2


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(DTYPES), min_size=1, max_size=5))
def test_any_chain_of_the_models_casts_keeps_its_values_exactly(dtypes):
    """The model's casts, in any order: cleanup may shorten the chain, never change a value."""
    x = (torch.randn(6) * 300).to(torch.float32)
    ep = export(CastChain(dtypes), x)
    expected = eager(CastChain(dtypes), x)
    CleanupCastsPass(Program(ep))(ep.graph_module)
    ep.graph_module.recompile()
    check_program(ep)
    got = run(ep, x)[0]
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


class WideningInBranches(torch.nn.Module):
    """The round trip of ``Widening`` inside both branches of a cond."""

    def forward(self, x):
        def up(a):
            return a.float().half().relu()

        def down(a):
            return a.float().half().neg()

        return torch.cond(x.sum() > 0, up, down, (x,))


def test_cond_branches_are_cleaned_too():
    ep = export(WideningInBranches(), HALF)
    bodies = [m for name, m in ep.graph_module.named_children() if "graph" in name]
    body_casts = lambda body: [n for n in body.graph.nodes if is_cast(n)]  # noqa: E731
    assert len(bodies) == 2 and all(body_casts(body) for body in bodies)
    assert CleanupCastsPass(Program(ep))(ep.graph_module).modified
    ep.graph_module.recompile()
    check_program(ep)
    assert all(body_casts(body) == [] for body in bodies)
    for sign in (1.0, -1.0):
        x = HALF.abs() * sign
        torch.testing.assert_close(run(ep, x)[0], eager(WideningInBranches(), x))
