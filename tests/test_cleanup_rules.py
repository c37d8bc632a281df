"""The cast-cleanup rules, each on its own, and the driver that runs them to a fixed point."""

import pytest
import torch

from fx16.casts import INSERTED, CastInserter
from fx16.passes import (
    BypassBranchingCastsPass,
    CleanupCastsPass,
    DeduplicateCastsPass,
    FuseCastChainsPass,
    RemoveNoopCastsPass,
)
from fx16.passes.cast_rule import KEPT_CAST
from fx16.program import Program
from helpers import casts, check_program, export, run

aten = torch.ops.aten
HALF = torch.randn(2, 3).half()


def _apply(rule_class, ep):
    result = rule_class(Program(ep))(ep.graph_module)
    ep.graph_module.recompile()
    check_program(ep)
    return result


def _expected(model, *args):
    with torch.no_grad():
        return model(*args)


class SameDtype(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float16).relu()


class Widening(torch.nn.Module):
    """x:f16 -> to(f32) -> to(f16) -> relu: the model's own round trip loses nothing."""

    def forward(self, x):
        return x.float().half().relu()


class Narrowing(torch.nn.Module):
    """x:f32 -> to(f16) -> to(f32): the model rounds to fp16 on purpose."""

    def forward(self, x):
        return x.half().float().relu()


class Branching(torch.nn.Module):
    """h = x.float() feeds exp and a cast back to f16."""

    def forward(self, x):
        h = x.float()
        return h.exp(), h.half() + 1


class TwoCasts(torch.nn.Module):
    def forward(self, x):
        return x.float().exp() + x.float().sin()


def test_noop_cast_is_removed():
    """x:f16 -> to(f16) -> relu   becomes   x -> relu."""
    ep = export(SameDtype(), HALF)
    assert _apply(RemoveNoopCastsPass, ep).modified
    assert casts(ep) == []
    torch.testing.assert_close(run(ep, HALF)[0], _expected(SameDtype(), HALF))


def test_noop_cast_returning_an_input_is_kept():
    class Identity(torch.nn.Module):
        def forward(self, x):
            return x.to(torch.float16)

    ep = export(Identity(), HALF)
    assert not _apply(RemoveNoopCastsPass, ep).modified
    (cast,) = casts(ep)
    assert "program input" in cast.meta[KEPT_CAST]


def test_lossless_model_chain_is_fused():
    """x:f16 -> to(f32) -> to(f16) -> relu   becomes   x -> to(f16) -> relu."""
    ep = export(Widening(), HALF)
    assert _apply(FuseCastChainsPass, ep).modified
    (cast,) = casts(ep)
    assert cast.args[0].op == "placeholder" and cast.args[1] == torch.float16
    torch.testing.assert_close(run(ep, HALF)[0], _expected(Widening(), HALF))


def test_model_narrowing_chain_is_kept_with_a_reason():
    x = torch.randn(2, 3)
    ep = export(Narrowing(), x)
    assert not _apply(FuseCastChainsPass, ep).modified
    assert len(casts(ep)) == 2
    assert "narrows here on purpose" in casts(ep)[1].meta[KEPT_CAST]


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
    assert _apply(FuseCastChainsPass, ep).modified
    (cast,) = casts(ep)
    assert cast is up and cast.args[0] is relu
    torch.testing.assert_close(run(ep, x)[0], _expected(Chain(), x))


def test_branching_cast_is_bypassed():
    """h = to(x, f32) -> {exp, to(h, f16) -> add}   becomes   {h -> exp, to(x, f16) -> add}."""
    ep = export(Branching(), HALF)
    assert _apply(BypassBranchingCastsPass, ep).modified
    half_cast = next(c for c in casts(ep) if c.args[1] == torch.float16)
    assert half_cast.args[0].op == "placeholder"
    for got, want in zip(run(ep, HALF), _expected(Branching(), HALF)):
        torch.testing.assert_close(got, want)


def test_fuse_leaves_branching_casts_to_bypass():
    ep = export(Branching(), HALF)
    assert not _apply(FuseCastChainsPass, ep).modified


def test_duplicate_casts_merge_into_the_first():
    """x -> to(f32) -> exp;  x -> to(f32) -> sin   becomes   x -> c=to(f32) -> {exp, sin}."""
    ep = export(TwoCasts(), HALF)
    first = casts(ep)[0]
    first.meta[INSERTED] = "upcast"  # one inserted, one the model's: the survivor is the model's
    assert _apply(DeduplicateCastsPass, ep).modified
    (cast,) = casts(ep)
    assert cast is first and len(cast.users) == 2
    assert INSERTED not in cast.meta
    torch.testing.assert_close(run(ep, HALF)[0], _expected(TwoCasts(), HALF))


@pytest.mark.parametrize("model", [SameDtype(), Widening(), Branching(), TwoCasts()])
def test_driver_reaches_a_fixed_point(model):
    ep = export(model, HALF)
    expected = _expected(model, HALF)
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
