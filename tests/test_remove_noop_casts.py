"""RemoveNoopCastsPass: drop casts to the dtype a value already has."""

import torch

from fx16.passes import RemoveNoopCastsPass
from fx16.passes.cast_rule import KEPT_CAST
from helpers import apply_rule, casts, eager, export, run
from models import SameDtypeCast

aten = torch.ops.aten
HALF = torch.randn(2, 3).half()
WRITTEN = "a write in place reaches the cast's result or its source; the copy keeps them apart"


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
    assert cast.meta[KEPT_CAST] == "removing it would return a program input as an output"


class CopyThenWriteSource(torch.nn.Module):
    """y = _to_copy(x, f16) on an fp16 x, then x.add_(1): y must keep x's old values."""

    def forward(self, x):
        x = x + 0
        y = aten._to_copy(x, dtype=torch.float16)
        x.add_(1)
        return x, y


class CopyThenWriteThroughView(torch.nn.Module):
    """y = _to_copy(x, f16), then a write through a view of y: x must not see it."""

    def forward(self, x):
        y = aten._to_copy(x, dtype=torch.float16)
        y.view(-1)[0:2].fill_(7)
        return x + 0, y


def test_noop_cast_a_write_reaches_is_kept():
    """x:f16 -> y=to(f16); x.add_(1)   keeps the copy: dropping it would show the write in y."""
    for model in (CopyThenWriteSource(), CopyThenWriteThroughView()):
        ep = export(model, HALF)
        assert not apply_rule(RemoveNoopCastsPass, ep).modified
        (cast,) = casts(ep)
        assert cast.meta[KEPT_CAST] == WRITTEN
        for got, want in zip(run(ep, HALF), eager(model, HALF)):
            torch.testing.assert_close(got, want)


class NoopCastBesideAWrite(torch.nn.Module):
    """c = to(x, f16) on an fp16 x, read by an op that writes into another value (z += c)
    and by relu: no write reaches c or x, so the copy goes."""

    def forward(self, x):
        c = x.to(torch.float16)
        z = x * 2
        z.add_(c)
        return z, c.relu()


def test_a_write_into_another_value_does_not_keep_a_noop_cast():
    ep = export(NoopCastBesideAWrite(), HALF)
    assert apply_rule(RemoveNoopCastsPass, ep).modified
    assert casts(ep) == []
    for got, want in zip(run(ep, HALF), eager(NoopCastBesideAWrite(), HALF)):
        torch.testing.assert_close(got, want)


class NoopCastOfAViewWhoseBaseIsWritten(torch.nn.Module):
    """c = _to_copy(view(h), f16) on an fp16 h, then h.add_(1): c must keep the old values."""

    def forward(self, x):
        h = x * 1
        c = aten._to_copy(h.view(-1), dtype=torch.float16)
        h.add_(1)
        return h, c


def test_a_write_into_the_base_of_a_casts_source_keeps_the_cast():
    ep = export(NoopCastOfAViewWhoseBaseIsWritten(), HALF)
    assert not apply_rule(RemoveNoopCastsPass, ep).modified
    for got, want in zip(run(ep, HALF), eager(NoopCastOfAViewWhoseBaseIsWritten(), HALF)):
        torch.testing.assert_close(got, want)


def test_a_returned_cast_removed_from_the_program_renames_its_output():
    """The program returns the cast: removing it makes the relu the output, and the
    signature's output spec follows the new name (a body's outputs have no spec)."""

    class ReturnsCast(torch.nn.Module):
        def forward(self, x):
            return x.relu().to(torch.float16)

    ep = export(ReturnsCast(), HALF)
    assert apply_rule(RemoveNoopCastsPass, ep).modified
    assert casts(ep) == []
    (returned,) = ep.graph_module.graph.output_node().args[0]
    assert returned.name == "relu"
    assert [spec.arg.name for spec in ep.graph_signature.output_specs] == ["relu"]
    torch.testing.assert_close(run(ep, HALF)[0], HALF.relu())
