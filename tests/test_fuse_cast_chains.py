"""FuseCastChainsPass: collapse cast chains, keeping the model's deliberate narrowing."""

import torch

from fx16.passes import FuseCastChainsPass
from fx16.passes.cast_rule import KEPT_CAST
from fx16.program.casts import CastInserter
from helpers import apply_rule, casts, eager, export, run
from models import Branching, Narrowing, Widening

aten = torch.ops.aten
HALF = torch.randn(2, 3).half()


def test_lossless_model_chain_is_fused():
    """x:f16 -> to(f32) -> to(f16) -> relu   becomes   x -> to(f16) -> relu."""
    ep = export(Widening(), HALF)
    assert apply_rule(FuseCastChainsPass, ep).modified
    (cast,) = casts(ep)
    assert cast.args[0].op == "placeholder" and cast.args[1] == torch.float16
    torch.testing.assert_close(run(ep, HALF)[0], eager(Widening(), HALF))


def test_model_narrowing_chain_is_kept_with_a_reason():
    x = torch.randn(2, 3)
    ep = export(Narrowing(), x)
    assert not apply_rule(FuseCastChainsPass, ep).modified
    assert len(casts(ep)) == 2
    assert casts(ep)[1].meta[KEPT_CAST] == (
        "the model narrows here on purpose (the chain changes range or resolution)"
    )


def test_inserted_narrowing_chain_is_fused():
    """relu:f32 -> to(f16)* -> to(f32)* -> exp  (* inserted)   becomes   relu -> to(f32) -> exp."""

    class Chain(torch.nn.Module):
        def forward(self, x):
            return x.relu().exp()

    x = torch.randn(2, 3)
    ep = export(Chain(), x)
    graph = ep.graph_module.graph
    relu = next(n for n in graph.nodes if n.target == aten.relu.default)
    inserter = CastInserter(graph)
    down = inserter.cast_after(relu, torch.float16, "cast-back")
    up = inserter.cast_after(down, torch.float32, "upcast")
    ep.graph_module.recompile()
    assert apply_rule(FuseCastChainsPass, ep).modified
    (cast,) = casts(ep)
    assert cast is up and cast.args[0] is relu
    torch.testing.assert_close(run(ep, x)[0], eager(Chain(), x))


def test_fuse_leaves_branching_casts_to_bypass():
    ep = export(Branching(), HALF)
    assert not apply_rule(FuseCastChainsPass, ep).modified


def test_inserted_cast_back_before_a_model_upcast_is_skipped():
    """relu:f32 -> to(f16)* -> model's to(f32) -> exp   becomes   relu -> to(f32) -> exp:
    the model asked for fp32 and now gets the unrounded value."""

    class Upcast(torch.nn.Module):
        def forward(self, x):
            return x.relu().to(torch.float32).exp()

    x = torch.randn(2, 3)
    ep = export(Upcast(), x)
    graph = ep.graph_module.graph
    relu = next(n for n in graph.nodes if n.target == aten.relu.default)
    CastInserter(graph).cast_after(relu, torch.float16, "cast-back")
    ep.graph_module.recompile()
    assert apply_rule(FuseCastChainsPass, ep).modified
    (cast,) = casts(ep)
    assert cast.args[0] is relu and cast.args[1] == torch.float32
    torch.testing.assert_close(run(ep, x)[0], eager(Upcast(), x))
