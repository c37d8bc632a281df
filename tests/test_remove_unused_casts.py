"""RemoveUnusedCastsPass: casts without users are erased."""

import torch

from fx16.passes import RemoveUnusedCastsPass
from fx16.program.casts import CastInserter
from helpers import apply_rule, casts, eager, export, run
from models import SameDtypeCast

HALF = torch.randn(2, 3).half()


def test_unused_cast_is_erased_and_used_ones_stay():
    """x -> to(f32) (no users), x -> to(f16) -> relu   becomes   x -> to(f16) -> relu."""
    ep = export(SameDtypeCast(), HALF)
    graph = ep.graph_module.graph
    placeholder = next(iter(graph.nodes))
    CastInserter(graph).cast(placeholder, torch.float32, "upcast")
    assert len(casts(ep)) == 2
    assert apply_rule(RemoveUnusedCastsPass, ep).modified
    (kept,) = casts(ep)
    assert kept.args[1] == torch.float16
    torch.testing.assert_close(run(ep, HALF)[0], eager(SameDtypeCast(), HALF))
    assert not apply_rule(RemoveUnusedCastsPass, ep).modified
