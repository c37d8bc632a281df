"""DeduplicateCastsPass: one cast per (value, dtype)."""

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from fx16.passes import DeduplicateCastsPass
from fx16.passes.cast_rule import KEPT_CAST
from fx16.program import Program
from fx16.program.casts import INSERTED, cast_dtype, is_cast
from helpers import apply_rule, casts, check_program, eager, export, run
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


class CastsIntoOneCond(torch.nn.Module):
    """Two casts of x to f32 are a cond's two operands; a third feeds exp."""

    def forward(self, x):
        a, b = x.to(torch.float32), x.to(torch.float32)
        chosen = torch.cond(x.sum() > 0, lambda a, b: a * 2.0 + b, lambda a, b: a - b, (a, b))
        return chosen, x.to(torch.float32).exp()


def test_a_higher_order_op_never_gets_one_tensor_as_two_operands():
    """cond(to(x, f32), to(x, f32)): merged, torch's functionalization of the cond would
    refuse the aliased operands (``run_decompositions`` fails), so the two stay apart;
    the third cast, read by exp, still merges into the first."""
    ep = export(CastsIntoOneCond(), HALF)
    assert apply_rule(DeduplicateCastsPass, ep).modified  # apply_rule decomposes it
    (cond,) = ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.cond)
    operands = cond.args[3]
    assert len(set(operands)) == 2 and len(casts(ep)) == 2
    (exp,) = ep.graph.find_nodes(op="call_function", target=aten.exp.default)
    assert exp.args[0] in operands
    for got, want in zip(run(ep, HALF), eager(CastsIntoOneCond(), HALF)):
        torch.testing.assert_close(got, want)


def test_a_value_whose_casts_all_stay_apart_says_why():
    ep = export(CastsIntoOneCond(), HALF)
    assert apply_rule(DeduplicateCastsPass, ep).modified  # the exp's cast merges
    assert not apply_rule(DeduplicateCastsPass, ep).modified  # the cond's two stay apart
    (x,) = [node for node in ep.graph.nodes if node.op == "placeholder"]
    assert "higher-order op" in x.meta[KEPT_CAST]


class BodyReturningTwoCasts(torch.nn.Module):
    """A cond body returning two casts of its operand (and reading a third)."""

    def forward(self, x):
        def both(y):
            return y.to(torch.float32) * 1.5, y.to(torch.float32), y.to(torch.float32)

        return torch.cond(x.sum() > 0, both, both, (x,))


def test_a_body_never_returns_one_tensor_as_two_outputs():
    """Inside the body, the two casts the output returns stay apart (torch refuses a
    body whose outputs alias); the one mul reads merges into the first of them."""
    ep = export(BodyReturningTwoCasts(), HALF)
    program = Program(ep)
    for name in ("true_graph_0", "false_graph_0"):
        body = getattr(ep.graph_module, name)
        assert DeduplicateCastsPass(program)(body).modified
        body.recompile()
        assert len([n for n in body.graph.nodes if is_cast(n)]) == 2
    ep.graph_module.recompile()
    check_program(ep)
    for got, want in zip(run(ep, HALF), eager(BodyReturningTwoCasts(), HALF)):
        torch.testing.assert_close(got, want)


class CastsInRoles(torch.nn.Module):
    """Casts of x: ``operands`` gives the dtype of the cast each of a cond's two operands
    is (None: ``x * 1.0``, no cast), ``others`` the dtype and reader (``exp`` or the
    program's output) of the rest."""

    def __init__(self, operands, others):
        super().__init__()
        self.operands, self.others = operands, others

    def forward(self, x):
        a, b = (x * 1.0 if dtype is None else x.to(dtype) for dtype in self.operands)
        chosen = torch.cond(
            x.sum() > 0,
            lambda a, b: a.double() * 2.0 + b.double(),
            lambda a, b: a.double() - b.double(),
            (a, b),
        )
        results = [chosen]
        for dtype, reader in self.others:
            cast = x.to(dtype)
            results.append(cast.exp() if reader == "exp" else cast)
        return tuple(results)


WIDE = st.sampled_from([torch.float32, torch.float64])


@settings(max_examples=examples(8))
@given(
    st.tuples(st.none() | WIDE, st.none() | WIDE),
    st.lists(st.tuples(WIDE, st.sampled_from(["exp", "output"])), max_size=3),
)
def test_property_casts_merge_except_where_one_op_would_read_them_as_two(operands, others):
    """Any mix of casts of x: after the rule, one cast per dtype, or two where both of
    the cond's operands are casts to it; the operands stay two tensors, the program
    decomposes (``apply_rule``'s check), and every output is eager's bit for bit."""
    model = CastsInRoles(operands, others)
    ep = export(model, HALF)
    apply_rule(DeduplicateCastsPass, ep)
    (cond,) = ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.cond)
    assert len(set(cond.args[3])) == 2
    for dtype in {*operands, *(dtype for dtype, _ in others)} - {None}:
        pair = operands[0] == operands[1] == dtype
        assert sum(cast_dtype(cast) == dtype for cast in casts(ep)) == (2 if pair else 1)
    for got, want in zip(run(ep, HALF), eager(model, HALF)):
        assert got.dtype == want.dtype and torch.equal(got, want)
