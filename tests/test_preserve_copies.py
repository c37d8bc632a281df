"""PreserveCopiesPass and the cast end to end: a copy never becomes an alias that a write
in place reaches, nor an alias a copy."""

import pytest
import torch
import torch.utils._pytree as pytree
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from fx16.decisions import PRECISION, Reason
from fx16.passes import PreserveCopiesPass
from fx16.program.casts import is_inserted
from fx16.testing import check_cast, programs
from helpers import check_program, eager, export, node_named, run, targets

aten = torch.ops.aten
ONES = torch.ones(3)


class WriteIntoCastCopy(torch.nn.Module):
    """y = x.to(f16); y.add_(1): the copy is written, x must not see it."""

    def forward(self, x):
        y = x.to(torch.float16)
        y.add_(1)
        return x * 2, y


class WriteIntoSourceAfterCast(torch.nn.Module):
    """y = x.to(f16); x.mul_(3): the source is written, the copy must not see it."""

    def forward(self, x):
        x = x + 0  # an activation, so the write is allowed
        y = x.to(torch.float16)
        x.mul_(3)
        return x, y + 1


class WriteThroughViewOfCopy(torch.nn.Module):
    """A write through a view of the copy."""

    def forward(self, x):
        y = x.to(torch.float16)
        y.view(-1)[0:2].fill_(7)
        return x + 1, y


class TypeAsWritten(torch.nn.Module):
    """type_as to another dtype copies; the copy is written."""

    def forward(self, x, w):
        y = x.type_as(w)
        y.mul_(3)
        return x + 1, y


class WriteIntoAlias(torch.nn.Module):
    """y = x.float() on an fp32 activation is x itself: the write shows in x."""

    def forward(self, x):
        x = x + 0
        y = x.float()
        y.add_(1)
        return x * 2


class WriteInsideABodyIntoACopyMadeOutside(torch.nn.Module):
    """The copy is made outside a no_grad region and written inside its body."""

    def forward(self, x):
        x = x + 0
        y = x.to(torch.float16)
        with torch.no_grad():
            y.add_(1)
        return x * 2, y


class WriteIntoAChunkOfTheCopy(torch.nn.Module):
    """The copy is written through one chunk of it (a getitem of a multi-view op)."""

    def forward(self, x):
        y = x.to(torch.float16)
        first, _ = y.chunk(2)
        first.add_(1)
        return x * 2, y


class CastCopyNotWritten(torch.nn.Module):
    """No write in place: nothing to pin."""

    def forward(self, x):
        return x.to(torch.float16) + 1, x * 2


@pytest.mark.parametrize(
    "model, pinned",
    [(WriteIntoCastCopy(), aten._to_copy.default), (WriteIntoAlias(), aten.alias.default)],
    ids=["copy", "alias"],
)
def test_a_written_conversion_is_pinned(model, pinned):
    """x -> to.dtype(f16) -> add_   becomes   x -> _to_copy(f16) -> add_;
    x:f32 -> to.dtype(f32) -> add_   becomes   x -> alias -> add_ (same values)."""
    ep = export(model, ONES)
    assert PreserveCopiesPass()(ep.graph_module).modified
    ep.graph_module.recompile()
    check_program(ep)
    assert targets(ep)[pinned] == 1
    assert targets(ep)[aten.to.dtype] == 0
    for got, want in zip(run(ep, ONES), pytree.tree_leaves(eager(model, ONES))):
        torch.testing.assert_close(got, want)


def test_a_conversion_nothing_writes_through_is_left_alone():
    """x -> to.dtype(f16) -> add   stays as it is."""
    ep = export(CastCopyNotWritten(), ONES)
    assert not PreserveCopiesPass()(ep.graph_module).modified
    assert targets(ep)[aten.to.dtype] == 1


@pytest.mark.parametrize(
    "model, args",
    [
        (WriteIntoCastCopy(), (ONES,)),
        (WriteIntoSourceAfterCast(), (ONES,)),
        (WriteThroughViewOfCopy(), (torch.arange(4.0),)),
        (TypeAsWritten(), (ONES, torch.ones(3, dtype=torch.float16))),
        (WriteIntoAlias(), (ONES,)),
        (WriteInsideABodyIntoACopyMadeOutside(), (ONES,)),
        (WriteIntoAChunkOfTheCopy(), (torch.ones(4),)),
    ],
    ids=[
        "copy-written",
        "source-written",
        "view-of-copy-written",
        "type_as",
        "alias-written",
        "written-in-a-body",
        "written-through-a-chunk",
    ],
)
@pytest.mark.parametrize("decompose", [False, True], ids=["training-ir", "aten"])
def test_the_cast_program_returns_eagers_values(model, args, decompose):
    """The issue's example and its kin: after the cast, every output equals eager's
    (the values are small integers, exact in fp16)."""
    ep = export(model, *args, decompose=decompose)
    fx16.cast_to_16_bit_precision(ep)
    check_program(ep)
    want = eager(model, *args)
    want = want if isinstance(want, tuple) else (want,)
    for got, expected in zip(run(ep, *args), want):
        torch.testing.assert_close(got.float(), expected.float())


def test_an_integer_conversion_is_pinned_too():
    """i:i64 -> to(i16) -> add_   becomes   i -> _to_copy(i16) -> add_: narrowing i to
    int16 later must not make the copy an alias."""

    class IntCopyWritten(torch.nn.Module):
        def forward(self, i):
            j = i.to(torch.int16)
            j.add_(5)
            return i * 2, j

    i = torch.arange(4)
    ep = export(IntCopyWritten(), i)
    assert PreserveCopiesPass()(ep.graph_module).modified
    assert targets(ep)[aten._to_copy.default] == 1 and targets(ep)[aten.to.dtype] == 0


class WriteInsideRegion(torch.nn.Module):
    """The issue's pattern inside a no_grad region (a wrap_with_set_grad_enabled body)."""

    def forward(self, x):
        x = x + 0
        with torch.no_grad():
            y = x.to(torch.float16)
            y.add_(1)
            z = x * 2
        return z, y


def test_a_conversion_inside_a_body_is_pinned():
    """The body's to.dtype becomes _to_copy; the cast program returns eager's values
    (without the pin: x * 2 = [4, 4, 4])."""
    ep = export(WriteInsideRegion(), ONES)
    assert PreserveCopiesPass()(ep.graph_module).modified
    (body,) = [m for m in ep.graph_module.children() if isinstance(m, torch.fx.GraphModule)]
    body_targets = [n.target for n in body.graph.nodes]
    assert aten._to_copy.default in body_targets and aten.to.dtype not in body_targets
    cast = export(WriteInsideRegion(), ONES)
    fx16.cast_to_16_bit_precision(cast)
    for got, expected in zip(run(cast, ONES), eager(WriteInsideRegion(), ONES)):
        torch.testing.assert_close(got.float(), expected.float())


WRITES = ("write_into_cast_copy", "write_into_source", "write_through_alias")


@settings(max_examples=examples(10))
@given(programs(menu=(*WRITES, "add", "mul", "linear", "relu", "scalar_mul"), max_steps=5))
def test_random_programs_with_writes_keep_their_values(case):
    """Programs mixing writes in place with ordinary ops: every policy's cast passes the
    float oracle (values within the emulated 16-bit bound, integers exact)."""
    check_cast(case, fx16.cast_to_16_bit_precision)


class OverflowingWriteThroughAlias(torch.nn.Module):
    """h = x * 1; h.float() is h itself; a write of 70000 into it through a view."""

    def forward(self, x):
        h = x * 1.0
        h.float().view(-1)[:1].fill_(70000.0)
        return h + 1.0


def test_a_write_that_overflows_16_bit_keeps_its_value():
    """An in-place op cannot change its target's dtype: the op that made the storage a
    write of 70000 reaches (``x * 1``) computes in fp32, the overflow rule says why, and
    its consumers read it without a 16-bit copy (a copy would miss the write)."""
    x = torch.ones(2, 2)
    ep = export(OverflowingWriteThroughAlias(), x)
    fx16.cast_to_16_bit_precision(ep)
    check_program(ep)
    torch.testing.assert_close(run(ep, x)[0].float(), eager(OverflowingWriteThroughAlias(), x))
    mul = node_named(ep, "mul")
    assert mul.meta["val"].dtype == torch.float32
    decision = mul.meta[PRECISION]
    assert decision.reason == Reason.ACTIVATION_OVERFLOW and "a write in place (fill_)" in (
        decision.detail
    )
    assert not any(is_inserted(user) for user in mul.users)  # no cast-back


class ConversionsIntoOneCond(torch.nn.Module):
    """cond(x.half(), x.half()): two copies of x, until the cast makes x fp16 and each
    ``to.dtype`` returns x itself (torch refuses a cond's operands aliasing each other)."""

    def forward(self, x):
        return torch.cond(
            x.sum() > 0,
            lambda a, b: a.float() * 2.0 + b.float(),
            lambda a, b: a.float() - b.float(),
            (x.half(), x.half()),
        )


class BodyReturningAConversion(torch.nn.Module):
    """A body returning ``a.half()`` of its operand: a copy, until the operand is fp16
    (torch refuses a body returning its input)."""

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda a: a.half(), lambda a: (a * 2.0).half(), (x * 3.0,))


def test_a_conversion_a_higher_order_op_reads_is_pinned():
    ep = export(ConversionsIntoOneCond(), ONES)
    assert PreserveCopiesPass()(ep.graph_module).modified
    ep.graph_module.recompile()
    check_program(ep)
    assert targets(ep)[aten._to_copy.default] == 2 and targets(ep)[aten.to.dtype] == 0


def test_a_conversion_a_body_returns_is_pinned():
    ep = export(BodyReturningAConversion(), ONES)
    assert PreserveCopiesPass()(ep.graph_module).modified
    body = ep.graph_module.true_graph_0
    body_targets = [n.target for n in body.graph.nodes]
    assert aten._to_copy.default in body_targets and aten.to.dtype not in body_targets


OPERAND_CONVERSIONS = {
    "half": lambda x: x.half(),
    "half, then float": lambda x: x.half().float(),
    "bfloat16": lambda x: x.bfloat16(),
    "double": lambda x: x.double(),
    "times one": lambda x: x * 1.0,
}
POLICIES = st.sampled_from([None, "always_fp16", "auto_mixed_bf16", "auto_mixed_conservative"])


class ConvertedOperands(torch.nn.Module):
    def __init__(self, first, second, returned):
        super().__init__()
        self.first, self.second, self.returned = first, second, returned

    def forward(self, x):
        def body(a, b):
            return OPERAND_CONVERSIONS[self.returned](a.float() * 2.0 + b.float())

        operands = (OPERAND_CONVERSIONS[self.first](x), OPERAND_CONVERSIONS[self.second](x))
        return torch.cond(x.sum() > 0, body, body, operands)


@settings(max_examples=examples(8))
@given(
    st.sampled_from(sorted(OPERAND_CONVERSIONS)),
    st.sampled_from(sorted(OPERAND_CONVERSIONS)),
    st.sampled_from(sorted(OPERAND_CONVERSIONS)),
    POLICIES,
)
def test_property_conversions_across_a_body_boundary_stay_valid(first, second, returned, policy):
    """A cond's operands and its body's result made by any of the model's conversions
    of x: under any policy the cast program lints, saves, decomposes (torch refuses
    aliased operands or outputs there) and returns eager's value within 16-bit error."""
    model = ConvertedOperands(first, second, returned)
    x = torch.tensor([[0.5, -1.25, 2.0], [3.0, 0.75, -0.5]])
    ep = export(model, x)
    fx16.cast_to_16_bit_precision(ep, **({} if policy is None else {"policy": policy}))
    check_program(ep)
    (got,) = run(ep, x)
    torch.testing.assert_close(got.double(), eager(model, x).double(), rtol=2e-2, atol=2e-2)
