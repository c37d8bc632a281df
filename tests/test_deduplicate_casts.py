"""DeduplicateCastsPass: one cast per (value, dtype)."""

import torch

from fx16.passes import DeduplicateCastsPass
from fx16.program.casts import INSERTED
from helpers import apply_rule, casts, eager, export, run
from models import TwoCasts

aten = torch.ops.aten
HALF = torch.randn(2, 3).half()


def test_duplicate_casts_merge_into_the_first():
    """x -> to(f32) -> exp;  x -> to(f32) -> sin   becomes   x -> c=to(f32) -> {exp, sin}."""
    ep = export(TwoCasts(), HALF)
    first = casts(ep)[0]
    first.meta[INSERTED] = "upcast"  # one inserted, one the model's: the survivor is the model's
    assert apply_rule(DeduplicateCastsPass, ep).modified
    (cast,) = casts(ep)
    assert cast is first and len(cast.users) == 2
    assert INSERTED not in cast.meta
    torch.testing.assert_close(run(ep, HALF)[0], eager(TwoCasts(), HALF))


class CastsAroundAWrite(torch.nn.Module):
    """a = to(x, f32); a write through a view of x; b = to(x, f32): b holds the written
    values, a does not."""

    def forward(self, x):
        x = x + 0
        a = x.to(torch.float32)
        x.view(-1).add_(1)
        b = x.to(torch.float32)
        return a, b


def test_casts_a_write_separates_are_not_merged():
    """to(x, f32); view(x).add_(1); to(x, f32)   keeps both casts."""
    ep = export(CastsAroundAWrite(), HALF)
    assert not apply_rule(DeduplicateCastsPass, ep).modified
    assert len(casts(ep)) == 2
    for got, want in zip(run(ep, HALF), eager(CastsAroundAWrite(), HALF)):
        torch.testing.assert_close(got, want)


class CastsToTwoDtypes(torch.nn.Module):
    """x -> to(f32) and x -> to(f64): two dtypes, nothing to merge."""

    def forward(self, x):
        return x.to(torch.float32).exp(), x.to(torch.float64).sin()


def test_casts_to_different_dtypes_are_not_merged():
    ep = export(CastsToTwoDtypes(), HALF)
    assert not apply_rule(DeduplicateCastsPass, ep).modified
    assert sorted(str(c.args[1]) for c in casts(ep)) == ["torch.float32", "torch.float64"]
    for got, want in zip(run(ep, HALF), eager(CastsToTwoDtypes(), HALF)):
        torch.testing.assert_close(got, want)


class OneCastThenTwo(torch.nn.Module):
    """x -> to(f32) once, x -> to(f64) twice: the f64 pair merges past the lone f32."""

    def forward(self, x):
        return x.to(torch.float32).exp(), x.to(torch.float64).sin(), x.to(torch.float64).cos()


def test_every_dtype_group_is_merged():
    ep = export(OneCastThenTwo(), HALF)
    assert apply_rule(DeduplicateCastsPass, ep).modified
    assert sorted(str(c.args[1]) for c in casts(ep)) == ["torch.float32", "torch.float64"]
    for got, want in zip(run(ep, HALF), eager(OneCastThenTwo(), HALF)):
        torch.testing.assert_close(got, want)
