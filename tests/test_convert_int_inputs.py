"""ConvertIntInputsPass: castable integer inputs with a fitting range become int16."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from int16_helpers import int_decisions, run_int16_stages

from fx16.decisions import Reason
from fx16.passes import ConvertIntInputsPass
from fx16.program.casts import INSERTED
from helpers import check_program, export, node_named, run
from models import Int32Arithmetic, PositionsAndMask

ARGS = (torch.tensor([3, -7, 100], dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.int32))


class SumAndRunningTotal(torch.nn.Module):
    """a + b fits int16; a.cumsum() over 3 values up to 30000 does not."""

    def forward(self, a, b):
        return a + b, a.cumsum(-1)


def test_input_read_by_int16_ops_becomes_int16():
    """a, b:i32 -> add/sub/mul (all int16)   becomes   a, b:i16 -> ... with no cast left on them."""
    ep = export(Int32Arithmetic(), *ARGS)
    run_int16_stages(ep, ConvertIntInputsPass, input_ranges={"a": (-100, 100), "b": (0, 9)})
    for name in ("a", "b"):
        placeholder = node_named(ep, name)
        assert placeholder.meta["val"].dtype == torch.int16
        assert all(user.meta["val"].dtype == torch.int16 for user in placeholder.users)
    assert [t.dtype for t in ep.example_inputs[0]] == [torch.int16, torch.int16]
    check_program(ep)
    for got, want in zip(run(ep, *ARGS), Int32Arithmetic()(*ARGS)):
        assert got.dtype == torch.int32 and torch.equal(got, want)


def test_wide_consumers_of_a_narrowed_input_read_a_cast_back():
    """a:i16 -> add (int16);  a:i16 -> to(i32)* -> cumsum (stays wide: 3 x 30000 > 32767)."""
    args = (
        torch.tensor([[30000, 1, 2]], dtype=torch.int32),
        torch.tensor([[1, 2, 3]], dtype=torch.int32),
    )
    ep = export(SumAndRunningTotal(), *args)
    run_int16_stages(ep, ConvertIntInputsPass, input_ranges={"a": (0, 30000), "b": (0, 9)})
    a = node_named(ep, "a")
    assert a.meta["val"].dtype == torch.int16
    back = next(user for user in a.users if user.meta.get(INSERTED) == "cast-back")
    assert back.kwargs["dtype"] == torch.int32
    assert [user.target for user in back.users] == [torch.ops.aten.cumsum.default]
    check_program(ep)
    for got, want in zip(run(ep, *args), SumAndRunningTotal()(*args)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_inputs_without_a_range_stay_wide():
    ep = export(Int32Arithmetic(), *ARGS)
    run_int16_stages(ep, ConvertIntInputsPass)
    decisions = int_decisions(ep)
    assert decisions["a"].dtype == torch.int32 and decisions["a"].reason == Reason.RANGE_UNKNOWN
    assert node_named(ep, "a").meta["val"].dtype == torch.int32


def test_range_beyond_int16_stays_wide():
    ep = export(Int32Arithmetic(), *ARGS)
    run_int16_stages(ep, ConvertIntInputsPass, input_ranges={"a": (0, 40000), "b": (0, 1)})
    decisions = int_decisions(ep)
    assert decisions["a"].reason == Reason.RANGE_EXCEEDS
    # b fits, but every op reading it also reads a: nothing would use an int16 b
    assert decisions["b"].reason == Reason.NO_INT16_CONSUMER


def test_index_inputs_stay_wide_even_with_a_range():
    args = (torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.bool))
    ep = export(PositionsAndMask(), *args)
    run_int16_stages(ep, ConvertIntInputsPass, input_ranges={"ids": (0, 99)})
    assert int_decisions(ep)["ids"].reason == Reason.UNSAFE_INDEX
    assert node_named(ep, "ids").meta["val"].dtype == torch.int64


def test_assume_safe_narrows_without_ranges():
    ep = export(Int32Arithmetic(), *ARGS)
    run_int16_stages(ep, ConvertIntInputsPass, int16="assume_safe")
    assert int_decisions(ep)["a"].reason == Reason.ASSUMED_SAFE


@settings(max_examples=12, deadline=None)
@given(st.integers(-40000, 40000), st.integers(0, 40000), st.integers(-40000, 40000))
def test_an_input_is_int16_exactly_when_its_range_fits_and_an_int16_op_reads_it(low, span, b_low):
    ranges = {"a": (low, low + span), "b": (b_low, b_low)}
    args = (torch.tensor([low], dtype=torch.int32), torch.tensor([b_low], dtype=torch.int32))
    ep = export(Int32Arithmetic(), *args)
    run_int16_stages(ep, ConvertIntInputsPass, input_ranges=ranges)
    decisions = int_decisions(ep)
    a_fits = -32768 <= low and low + span <= 32767
    narrowed_ops = [
        n for n, d in decisions.items() if d.dtype == torch.int16 and n not in ("a", "b")
    ]
    assert (decisions["a"].dtype == torch.int16) == (a_fits and bool(narrowed_ops))
    for name, decision in decisions.items():
        if decision.dtype == torch.int16:
            assert decision.reason == Reason.FITS, name
    check_program(ep)
    for got, want in zip(run(ep, *args), Int32Arithmetic()(*args)):
        assert got.dtype == want.dtype and torch.equal(got, want)
