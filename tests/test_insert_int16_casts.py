"""InsertInt16CastsPass and the whole int16 pipeline: narrow only what cannot wrap."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from int16_helpers import int_decisions, narrowed, run_int16_stages

import fx16
from fx16.decisions import Reason
from fx16.passes import InsertInt16CastsPass
from fx16.program.casts import INSERTED
from fx16.testing.strategies import integer_cases
from helpers import check_program, export, run, targets
from models import (
    BucketHash,
    CumsumCounter,
    GatherComputedIndex,
    Int32Arithmetic,
    PositionsAndMask,
    Square,
)

aten = torch.ops.aten


def _exact(ep, model, *args):
    with torch.no_grad():
        expected = model(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = run(ep, *args)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        if e.is_floating_point():
            torch.testing.assert_close(g, e)
        else:
            assert torch.equal(g, e)


def test_fitting_ops_run_in_int16_and_results_keep_their_dtype():
    """a, b:i32 in [-50, 50] -> add, sub, add, mul all int16; outputs come back as int32."""
    args = (
        torch.tensor([3, -7, 50], dtype=torch.int32),
        torch.tensor([1, 2, -3], dtype=torch.int32),
    )
    ep = export(Int32Arithmetic(), *args)
    fx16.cast_int32_to_int16(ep, input_ranges={"a": (-50, 50), "b": (-50, 50)})
    check_program(ep)
    assert narrowed(ep) == {"a", "b", "add", "sub", "add_1", "mul"}
    for node in ep.graph_module.graph.nodes:
        if node.target in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor):
            assert node.meta["val"].dtype == torch.int16
            assert all(arg.meta["val"].dtype == torch.int16 for arg in node.all_input_nodes)
    # only the casts back to int32 at the two outputs are left
    assert targets(ep)[aten._to_copy.default] == 2
    _exact(ep, Int32Arithmetic(), *args)


def test_bucket_hash_stays_exact():
    """(ids * 1000 + ids) % 97 with ids in [0, 999]: the sum reaches 999999, so nothing narrows."""
    ids = torch.tensor([[998, 17, 500, 999]])
    ep = export(BucketHash(), ids)
    fx16.cast_int32_to_int16(ep, input_ranges={"ids": (0, 999)})
    check_program(ep)
    assert narrowed(ep) == set()
    decisions = int_decisions(ep)
    assert decisions["add"].reason == Reason.RANGE_EXCEEDS and "999999" in decisions["add"].detail
    assert decisions["mul"].reason == Reason.SCALAR_OPERAND
    _exact(ep, BucketHash(), ids)


def test_product_of_300s_is_not_narrowed():
    args = (torch.tensor([300, -300]), torch.tensor([300, 300]))
    ep = export(Square(), *args)
    fx16.cast_int32_to_int16(ep, input_ranges={"a": (-300, 300), "b": (-300, 300)})
    assert int_decisions(ep)["mul"].reason == Reason.RANGE_EXCEEDS
    _exact(ep, Square(), *args)
    assert run(ep, *args)[0].tolist() == [90000, -90000]


def test_assume_safe_wraps_as_documented():
    """int16='assume_safe' narrows unchecked, like coreai-opt: 300 * 300 wraps to 24464."""
    args = (torch.tensor([300]), torch.tensor([300]))
    ep = export(Square(), *args)
    fx16.cast_int32_to_int16(ep, int16="assume_safe")
    assert int_decisions(ep)["mul"].reason == Reason.ASSUMED_SAFE
    assert run(ep, *args)[0].tolist() == [24464]
    assert run(ep, *args)[0].dtype == torch.int64  # the dtype is still restored


def test_cumsum_beyond_int16_stays_wide():
    length = torch.export.Dim("length", max=4096)
    args = (torch.full((1, 8), 10), torch.ones(1, 8, dtype=torch.int64))
    ep = export(CumsumCounter(), *args, dynamic_shapes=({1: length}, {1: length}))
    fx16.cast_int32_to_int16(ep, input_ranges={"steps": (0, 10), "offset": (0, 1)})
    check_program(ep)
    decisions = int_decisions(ep)
    assert decisions["add"].dtype == torch.int16
    assert decisions["cumsum"].reason == Reason.RANGE_EXCEEDS
    _exact(ep, CumsumCounter(), *args)


def test_index_paths_and_constants_stay_wide():
    length = torch.export.Dim("length", max=64)
    args = (torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.bool))
    model = PositionsAndMask()
    ep = export(model, *args, dynamic_shapes=({1: length}, {1: length}))
    fx16.cast_int32_to_int16(ep, input_ranges={"ids": (0, 99)})
    check_program(ep)
    decisions = int_decisions(ep)
    for name in ("arange", "cumsum", "sub", "clamp"):
        assert decisions[name].reason == Reason.UNSAFE_INDEX, name
    assert narrowed(ep) == {"remainder", "add_2", "mul"}
    _exact(ep, model, *args)


def test_gather_with_computed_index():
    args = (torch.randn(2, 5), torch.randint(0, 5, (2, 3)))
    ep = export(GatherComputedIndex(), *args)
    fx16.cast_int32_to_int16(ep, input_ranges={"ids": (0, 4)})
    check_program(ep)
    assert narrowed(ep) == {"add_1"}
    _exact(ep, GatherComputedIndex(), *args)


def test_inserter_alone_marks_casts_and_is_idempotent():
    args = (torch.tensor([3], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    ep = export(Int32Arithmetic(), *args)
    stage = run_int16_stages(ep, InsertInt16CastsPass, input_ranges={"a": (0, 9), "b": (0, 9)})
    assert all(
        n.meta[INSERTED] in ("narrow", "cast-back")
        for n in ep.graph_module.graph.nodes
        if INSERTED in n.meta
    )
    code = ep.graph_module.code
    assert not stage(ep.graph_module).modified
    ep.graph_module.recompile()
    assert ep.graph_module.code == code


def test_bad_mode_is_refused():
    ep = export(Square(), torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(fx16.InvalidOptionError, match="int16='always'"):
        fx16.cast_int32_to_int16(ep, int16="always")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(integer_cases())
def test_integer_outputs_are_bit_exact_and_nothing_narrows_without_a_fitting_range(case):
    model, args, input_ranges, draw_inputs = case
    ep = export(model, *args)
    fx16.cast_int32_to_int16(ep, input_ranges=input_ranges)
    check_program(ep)
    for name, decision in int_decisions(ep).items():
        if decision.dtype == torch.int16:
            assert decision.reason == Reason.FITS, name
    for seed in range(3):
        inputs = draw_inputs(seed)
        with torch.no_grad():
            expected = model(*inputs)
        for got, want in zip(run(ep, *inputs), expected):
            assert got.dtype == want.dtype and torch.equal(got, want)


def test_observed_ranges_narrow_only_when_asked():
    """Without input_ranges the example inputs' ranges are only observed: "proven" keeps
    everything wide, "observed" narrows and says the ranges were observed."""
    args = (
        torch.tensor([3, -7, 50], dtype=torch.int32),
        torch.tensor([1, 2, -3], dtype=torch.int32),
    )
    proven = fx16.cast_int32_to_int16(export(Int32Arithmetic(), *args))
    assert narrowed(proven) == set()
    observed = fx16.cast_int32_to_int16(export(Int32Arithmetic(), *args), int16="observed")
    check_program(observed)
    assert narrowed(observed) == {"a", "b", "add", "sub", "add_1", "mul"}
    assert "(observed)" in int_decisions(observed)["add"].detail
    _exact(observed, Int32Arithmetic(), *args)


@pytest.mark.parametrize("decompose", [False, True])
def test_a_batch_norms_step_counter_is_a_state_update_not_constant_foldable(decompose):
    """A train-mode BatchNorm's ``num_batches_tracked += 1`` (``add_`` in the training IR,
    an ``add`` written back as a buffer mutation in the ATen dialect) depends on no user
    input, but it updates the program's state: once told as "constant-foldable"."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    ep = torch.export.export(model, (torch.randn(8, 4),))  # in train mode, as it is
    if decompose:
        ep = ep.run_decompositions()
    fx16.cast_to_16_bit_precision(ep)
    adds = (torch.ops.aten.add_.Tensor, torch.ops.aten.add.Tensor)
    counters = [
        n for n in ep.graph.nodes if n.target in adds and n.meta["val"].dtype == torch.int64
    ]
    assert counters
    assert {int_decisions(ep)[n.name].reason for n in counters} == {Reason.IN_PLACE}
