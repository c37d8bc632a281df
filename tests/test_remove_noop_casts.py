"""RemoveNoopCastsPass: drop casts to the dtype a value already has."""

import torch

from fx16.passes import RemoveNoopCastsPass
from fx16.passes.cast_rule import KEPT_CAST
from helpers import apply_rule, casts, eager, export, run
from models import SameDtypeCast

aten = torch.ops.aten
HALF = torch.randn(2, 3).half()


def test_noop_cast_is_removed():
    """x:f16 -> to(f16) -> relu   becomes   x -> relu."""
    ep = export(SameDtypeCast(), HALF)
    assert apply_rule(RemoveNoopCastsPass, ep).modified
    assert casts(ep) == []
    torch.testing.assert_close(run(ep, HALF)[0], eager(SameDtypeCast(), HALF))


def test_noop_cast_returning_an_input_is_kept():
    class Identity(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float16)

    ep = export(Identity(), HALF)
    assert not apply_rule(RemoveNoopCastsPass, ep).modified
    (cast,) = casts(ep)
    assert "program input" in cast.meta[KEPT_CAST]
