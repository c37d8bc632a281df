"""DeduplicateCastsPass: one cast per (value, dtype)."""

import torch

from fx16.casts import INSERTED
from fx16.passes import DeduplicateCastsPass
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
