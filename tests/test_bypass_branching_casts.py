"""BypassBranchingCastsPass: a cast of a shared cast reads the original."""

import torch

from fx16.passes import BypassBranchingCastsPass
from helpers import apply_rule, casts, eager, export, run
from models import Branching

aten = torch.ops.aten
HALF = torch.randn(2, 3).half()


def test_branching_cast_is_bypassed():
    """h = to(x, f32) -> {exp, to(h, f16) -> add}   becomes   {h -> exp, to(x, f16) -> add}."""
    ep = export(Branching(), HALF)
    assert apply_rule(BypassBranchingCastsPass, ep).modified
    half_cast = next(c for c in casts(ep) if c.args[1] == torch.float16)
    assert half_cast.args[0].op == "placeholder"
    for got, want in zip(run(ep, HALF), eager(Branching(), HALF)):
        torch.testing.assert_close(got, want)
