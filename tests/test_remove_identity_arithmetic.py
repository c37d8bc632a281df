"""RemoveIdentityArithmeticPass: drop ``x * 1``, ``x / 1``, ``x + 0`` and ``x - 0``."""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import fx16
from fx16.passes import RemoveIdentityArithmeticPass
from fx16.passes.cast_rule import KEPT_CAST
from helpers import apply_rule, eager, export, run

aten = torch.ops.aten
IDENTITY_OPS = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor}


def leaves(outputs) -> list[torch.Tensor]:
    return pytree.tree_leaves(outputs)


def arithmetic(ep) -> list[str]:
    return [node.name for node in ep.graph.nodes if node.target in IDENTITY_OPS]


def identities(ep) -> list[str]:
    """The add, sub, mul and div nodes left with a scalar 0 or 1."""
    return [
        name
        for name, node in ((n.name, n) for n in ep.graph.nodes if n.target in IDENTITY_OPS)
        if not isinstance(node.args[1], (bool, torch.fx.Node)) and node.args[1] in (0, 1)
    ]


class Identities(torch.nn.Module):
    def forward(self, x):
        h = x.relu()
        return (((h * 1.0) / 1 + 0) - 0.0) * 2, h * 1


class IntegerIdentities(torch.nn.Module):
    def forward(self, ids):
        h = ids.abs()
        return ((h * 1 + 0) - 0) * 3, torch.mul(h, 1)


@pytest.mark.parametrize(
    ("model", "dtype"),
    [
        (Identities(), torch.float32),
        (Identities(), torch.float16),
        (IntegerIdentities(), torch.int32),
    ],
    ids=["float32", "float16", "int32"],
)
def test_each_identity_is_removed_and_the_values_stay(model, dtype):
    x = (torch.randn(3, 4) * 10).to(dtype)
    ep = export(model, x)
    assert apply_rule(RemoveIdentityArithmeticPass, ep).modified
    assert identities(ep) == []
    for got, want in zip(run(ep, x), leaves(eager(model, x))):  # division by 0 gives nan
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


class Promotes(torch.nn.Module):
    """An integer times 1.0 is a float, and a divison of one is too: not x's value."""

    def forward(self, ids):
        return ids * 1.0, ids / 1, ids + 0


def test_a_promoting_op_is_kept():
    ids = torch.arange(6).reshape(2, 3)
    ep = export(Promotes(), ids)
    assert not apply_rule(RemoveIdentityArithmeticPass, ep).modified
    assert arithmetic(ep) == ["mul", "div", "add"]


class NotIdentities(torch.nn.Module):
    """Scalars other than the identity, a tensor of ones, ``alpha`` on an add of 1, a
    ``True`` scalar (a bool, not the number 1) and a broadcast: none is x."""

    def forward(self, x, ones):
        return x * 1.5, x + 1, x * ones, torch.add(x, 1, alpha=0), x * True, x + torch.zeros(1)


def test_other_scalars_and_tensors_are_kept():
    x = torch.randn(3, 4)
    ep = export(NotIdentities(), x, torch.ones(3, 4))
    assert not apply_rule(RemoveIdentityArithmeticPass, ep).modified
    assert len(arithmetic(ep)) == 6


class StridedThenViewed(torch.nn.Module):
    """``x[:, ::2] * 1`` is a contiguous copy of a strided slice; ``view(-1)`` needs it."""

    def forward(self, x):
        return (x[:, ::2] * 1).view(-1)


def test_a_copy_with_other_strides_is_kept():
    x = torch.randn(3, 4)
    ep = export(StridedThenViewed(), x)
    assert not apply_rule(RemoveIdentityArithmeticPass, ep).modified
    assert torch.equal(run(ep, x)[0], x[:, ::2].reshape(-1))


class WriteIntoTheCopy(torch.nn.Module):
    """``y = x * 1`` then ``y.add_(1)``: x must keep its values."""

    def forward(self, x):
        h = x.relu()
        y = h * 1
        y.add_(1)
        return h, y


class ReturnsTheInput(torch.nn.Module):
    def forward(self, x):
        return x * 1


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (
            WriteIntoTheCopy(),
            "a write in place reaches the op's result or its source; the copy keeps them apart",
        ),
        (ReturnsTheInput(), "removing it would return a program input as an output"),
    ],
    ids=["written", "returns_input"],
)
def test_refusals_are_recorded_and_the_values_stay(model, reason):
    x = torch.randn(3, 4)
    ep = export(model, x)
    assert not apply_rule(RemoveIdentityArithmeticPass, ep).modified
    (kept,) = (node for node in ep.graph.nodes if node.target == aten.mul.Tensor)
    assert kept.meta[KEPT_CAST] == reason
    for got, want in zip(run(ep, x), leaves(eager(model, x))):
        assert torch.equal(got, want)


class RotaryScale(torch.nn.Module):
    """A rotary embedding's ``cos * attention_scaling`` with a scale of 1."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))

    def forward(self, x, positions):
        angles = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = angles.cos() * 1.0, angles.sin() * 1.0
        return x[..., :4] * cos + x[..., 4:] * sin


def test_the_cast_program_has_no_identity_arithmetic_left():
    x, positions = torch.randn(16, 8), torch.arange(16)
    ep = fx16.cast_fp32_to_fp16(export(RotaryScale(), x, positions))
    assert not [
        node for node in ep.graph.nodes if node.target == aten.mul.Tensor and 1.0 in node.args
    ]
    (got,) = run(ep, x, positions)
    torch.testing.assert_close(
        got.float(), eager(RotaryScale(), x, positions), rtol=2e-3, atol=2e-3
    )


# a chain of ops on x: (op, scalar), then whether a write lands on the last value
_OPS = {
    "mul": lambda h, c: h * c,
    "div": lambda h, c: h / c,
    "add": lambda h, c: h + c,
    "sub": lambda h, c: h - c,
}


class Chain(torch.nn.Module):
    def __init__(self, steps, write_at):
        super().__init__()
        self.steps, self.write_at = steps, write_at

    def forward(self, x):
        values = [x.relu()]
        for position, (op, scalar) in enumerate(self.steps):
            values.append(_OPS[op](values[-1], scalar))
            if position == self.write_at:
                values[-1].add_(1)
        return tuple(values)


@settings(deadline=None, max_examples=examples(30))
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(sorted(_OPS)), st.sampled_from([0, 1, 0.0, 1.0, 2.0, 0.5])),
        min_size=1,
        max_size=5,
    ),
    write_at=st.integers(-1, 4),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_property_every_identity_goes_unless_refused_and_the_values_are_eagers(
    steps, write_at, dtype
):
    """Every value the chain makes stays eager's, and each identity the chain holds is
    either gone or kept with its reason."""
    x = torch.randn(4, 5).to(dtype)
    model = Chain(steps, write_at)
    ep = export(model, x)
    apply_rule(RemoveIdentityArithmeticPass, ep)
    for node in ep.graph.nodes:
        if node.target in IDENTITY_OPS and node.args[1] == (
            1 if node.target in (aten.mul.Tensor, aten.div.Tensor) else 0
        ):
            assert KEPT_CAST in node.meta
    for got, want in zip(run(ep, x), leaves(eager(model, x))):  # division by 0 gives nan
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


class BranchReturns(torch.nn.Module):
    """A cond branch whose results would alias its input (a view of it) or each other
    once ``* 1`` goes; a higher-order op's body may return neither."""

    def forward(self, x):
        def true_branch(x):
            h = x.relu()
            return x.view(-1) * 1, h, h * 1

        def false_branch(x):
            return x.view(-1) + 1, x + 2, x + 3

        return torch.cond(x.sum() > 0, true_branch, false_branch, (x,))


def test_a_body_never_returns_its_input_or_one_tensor_twice():
    x = torch.randn(3, 4).abs()
    ep = fx16.cast_fp32_to_fp16(export(BranchReturns(), x))
    body = ep.graph_module.true_graph_0
    reasons = sorted(
        node.meta[KEPT_CAST] for node in body.graph.nodes if node.target == aten.mul.Tensor
    )
    assert reasons == [
        "removing it would return a program input as an output",
        "removing it would return one tensor as two outputs",
    ]
    for got, want in zip(run(ep, x), leaves(eager(BranchReturns(), x))):
        torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)
