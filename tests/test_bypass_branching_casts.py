"""BypassBranchingCastsPass: a cast of a shared cast reads the original."""

import torch

from fx16.passes import BypassBranchingCastsPass
from helpers import apply_rule, casts, eager, export, run
from models import Branching

aten = torch.ops.aten
HALF = torch.randn(2, 3).half()
WRITTEN = "a write in place reaches the cast's result or its source; the copy keeps them apart"


def test_branching_cast_is_bypassed():
    """h = to(x, f32) -> {exp, to(h, f16) -> add}   becomes   {h -> exp, to(x, f16) -> add}."""
    ep = export(Branching(), HALF)
    assert apply_rule(BypassBranchingCastsPass, ep).modified
    half_cast = next(c for c in casts(ep) if c.args[1] == torch.float16)
    assert half_cast.args[0].op == "placeholder"
    for got, want in zip(run(ep, HALF), eager(Branching(), HALF)):
        torch.testing.assert_close(got, want)


class WrittenSharedCast(torch.nn.Module):
    """h = to(x, f32); a write through a view of h; to(h, f16) must see the write."""

    def forward(self, x):
        h = x.to(torch.float32)
        h.view(-1).add_(1)
        return h.exp(), h.to(torch.float16)


def test_a_cast_of_a_written_cast_is_not_bypassed():
    """h = to(x, f32) -> {view -> add_, to(h, f16)}   stays: reading x would skip the write."""
    ep = export(WrittenSharedCast(), HALF)
    assert not apply_rule(BypassBranchingCastsPass, ep).modified
    half_cast = next(c for c in casts(ep) if c.args[1] == torch.float16)
    assert half_cast.meta["fx16.kept_cast"] == WRITTEN
    for got, want in zip(run(ep, HALF), eager(WrittenSharedCast(), HALF)):
        torch.testing.assert_close(got, want)
