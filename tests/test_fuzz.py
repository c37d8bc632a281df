"""Properties every entry point and the main policies keep on random programs drawn from
the whole op menu (fx16.testing.random_programs). Examples per property: the hypothesis
profile's (conftest.py); ``FX16_FUZZ=long`` runs 10,000 each."""

import copy
import itertools
from unittest import mock

import torch
import torch.utils._pytree as pytree
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from fx16.passes import (
    BypassBranchingCastsPass,
    DeduplicateCastsPass,
    FuseCastChainsPass,
    RemoveNoopCastsPass,
    RemoveUnusedCastsPass,
)
from fx16.report import report_of
from fx16.testing.checks import check_outputs
from fx16.testing.random_programs import RandomProgram
from fx16.testing.strategies import ProgramCase, programs, well_conditioned_programs
from helpers import assert_same_state, check_program, run, state_snapshot


def _policy(name):
    return lambda ep, case: fx16.cast_to_16_bit_precision(
        ep, policy=name, input_ranges=case.input_ranges
    )


ENTRY_POINTS = {
    "cast_fp32_to_fp16": lambda ep, case: fx16.cast_fp32_to_fp16(ep),
    "cast_int32_to_int16": lambda ep, case: fx16.cast_int32_to_int16(
        ep, input_ranges=case.input_ranges
    ),
    "cast_to_16_bit_precision": lambda ep, case: fx16.cast_to_16_bit_precision(
        ep, input_ranges=case.input_ranges
    ),
    "auto_mixed_conservative": _policy("auto_mixed_conservative"),
    "auto_mixed_bf16": _policy("auto_mixed_bf16"),
    "always_fp16": _policy("always_fp16"),
    "autocast": _policy("autocast"),
    "range_fallback_bf16": lambda ep, case: fx16.cast_fp32_to_fp16(ep, range_fallback="bf16"),
}
entry_points = st.sampled_from(sorted(ENTRY_POINTS))

# Property 5's bound: max |error| / max(1, max |fp64 output|) on well-conditioned programs
# (fx16.testing.random_programs WELL_CONDITIONED) when no fallback rule kept an op in fp32.
ERROR_BOUND = {torch.float16: 1e-2, torch.bfloat16: 6e-2}

CLEANUP_RULES = [
    DeduplicateCastsPass,
    FuseCastChainsPass,
    BypassBranchingCastsPass,
    RemoveNoopCastsPass,
    RemoveUnusedCastsPass,
]


def _cast(case, entry):
    ep = case.export()
    ENTRY_POINTS[entry](ep, case)
    return ep


def _outputs(ep, args):
    with torch.no_grad():
        return pytree.tree_leaves(ep.module()(*args))


@settings(max_examples=examples(10))
@given(programs(), entry_points)
def test_1_2_cast_never_raises_and_leaves_a_valid_program(case, entry):
    """No exception at all on a valid program; the result lints, validates, runs,
    saves and loads, decomposes, and every node's recorded dtype is the computed one."""
    check_program(_cast(case, entry))


@settings(max_examples=examples(10))
@given(programs(), entry_points, st.integers(0, 2**16))
def test_3_integer_outputs_are_bit_exact_inside_the_declared_ranges(case, entry, seed):
    inputs = case.inputs(seed)
    expected = _outputs(case.export(), inputs)
    got = run(_cast(case, entry), *inputs)
    for want, have in zip(expected, got):
        if not want.is_floating_point():
            assert have.dtype == want.dtype
            assert torch.equal(have, want)


@settings(max_examples=examples(10))
@given(programs(), entry_points)
def test_4_outputs_agree_with_fp32_within_the_float_oracle(case, entry):
    """On the calibration inputs: integers exact, no inf/nan that fp32 does not have
    (sentinels |v| >= 1e38 may saturate), and every float output within the float
    oracle's bound (fx16.testing.oracle: a small multiple of the error of the fp32
    program rounded where the cast computes 16-bit), on every program, fallbacks or not."""
    original = case.export()
    ep = copy.deepcopy(original)
    ENTRY_POINTS[entry](ep, case)
    check_outputs(original, ep, case.args)


@settings(max_examples=examples(12))
@given(
    well_conditioned_programs,
    st.sampled_from(["cast_fp32_to_fp16", "cast_to_16_bit_precision", "auto_mixed_bf16"]),
)
def test_5_float_error_is_bounded_when_no_fallback_fired(case, entry):
    model64 = copy.deepcopy(case.model).double()
    x, ids = case.args
    with torch.no_grad():
        reference = pytree.tree_leaves(model64(x.double(), ids))
    ep = _cast(case, entry)
    rows = [row for row in report_of(ep).rows if row.kind == "float"]
    if any(row.dtype == "float32" for row in rows):
        return  # a rule kept something in fp32: the bound does not apply
    low = torch.bfloat16 if entry == "auto_mixed_bf16" else torch.float16
    for want, have in zip(reference, run(ep, *case.args)):
        if want.is_floating_point():
            scale = want.abs().max().clamp_min(1.0)
            assert (have.double() - want).abs().max() / scale <= ERROR_BOUND[low]


@settings(max_examples=examples(12))
@given(programs(), entry_points)
def test_6_casting_twice_equals_casting_once(case, entry):
    ep = _cast(case, entry)
    once = state_snapshot(ep)
    ENTRY_POINTS[entry](ep, case)
    assert_same_state(once, state_snapshot(ep))


def _stages(ep, entry):
    passes = fx16.fp16_passes(ep, range_fallback="bf16") + fx16.int16_passes(ep)
    return sorted({type(p) for p in passes} | set(CLEANUP_RULES), key=lambda c: c.__name__)


@settings(max_examples=examples(12))
@given(programs(), entry_points, st.data())
def test_7_a_failing_stage_leaves_the_program_as_it_was(case, entry, data):
    ep = case.export()
    stage = data.draw(st.sampled_from(_stages(ep, entry)), label="stage")
    before = state_snapshot(ep)
    input_dtypes = [t.dtype for t in pytree.tree_leaves(ep.example_inputs)]
    original, calls = stage.call, []

    def half_done_then_fail(self, graph_module):
        calls.append(stage)
        original(self, graph_module)
        raise RuntimeError("injected failure")

    with mock.patch.object(stage, "call", half_done_then_fail):
        try:
            ENTRY_POINTS[entry](ep, case)
        except fx16.PassFailedError as error:
            assert calls and "injected failure" in str(error)
        else:
            assert not calls, f"{stage.__name__} failed but the cast went on"
            return
    assert_same_state(before, state_snapshot(ep))
    assert [t.dtype for t in pytree.tree_leaves(ep.example_inputs)] == input_dtypes


# ---- the shrunk examples of bugs the fuzzer found ---------------------------------------


def _shrunk(steps) -> ProgramCase:
    torch.manual_seed(0)
    model = RandomProgram(2, steps, []).eval()
    x = torch.tensor([[0.6577, 0.9387], [1.1317, -0.6455]])
    ids = torch.tensor([[4, 1], [15, 4]])
    return ProgramCase(model, (x, ids), dynamic=False, decompose=False, input_scale=1.0)


def test_found_a_dead_node_before_an_autocast_region():
    """torch.export left the dead ``abs`` out of its input's users (fixed in Program)."""
    steps = [("abs", 0, 0, 1.0), ("abs", 1, 0, 1.0), ("autocast_bf16", 0, 1, 1.0)]
    steps.append(("abs", 0, 0, 1.0))
    test_1_2_cast_never_raises_and_leaves_a_valid_program.hypothesis.inner_test(
        _shrunk(steps), "always_fp16"
    )


def test_found_an_assertion_between_two_explicit_regions_cast_twice():
    """The way out of one region's assertion was rebuilt on the second cast (fixed in
    InsertFP16CastsPass: nodes decided on an earlier run keep their inputs)."""
    steps = [("explicit_fp32_norm", 0, 0, 1e-09), ("explicit_fp32_norm", 5, 0, 1e-09)]
    test_6_casting_twice_equals_casting_once.hypothesis.inner_test(
        _shrunk(steps), "auto_mixed_bf16"
    )


def test_found_an_autocast_weight_cast_left_for_cleanup_cast_twice():
    """A decomposed bf16 autocast region casts a weight fx16 had made bf16 already: the
    no-op cast hid the narrowed weight from the ops after it, and once cleanup dropped
    it the second cast kept an op the first had left (fixed in fx16.plan.planner: such a
    cast carries its value's decision)."""
    steps = [("abs", 0, 0, 1e-09), ("abs", 0, 0, 1e-09), ("autocast_bf16", 0, 0, 1e-09)]
    case = _shrunk([*steps, ("bucketed_index", 3, 0, 1e-09)])
    case.decompose = True
    test_6_casting_twice_equals_casting_once.hypothesis.inner_test(case, "auto_mixed_bf16")


def test_found_a_second_cast_redirecting_an_op_it_had_decided():
    """x's 16-bit round trip becomes fp32 x, an explicit fp32 region (kept by
    auto_mixed_conservative), and an add that overflows reads that fp32 x too; the
    second cast opened the region again and sent the add, decided on the first run, the
    16-bit x (the same numbers by type promotion, another graph; fixed in
    fx16.plan.planner: an op decided on an earlier run keeps what it reads)."""
    steps = [("to_fp16_and_back", 0, 0, 1e-09), ("amax", 1, 0, 1e-09), ("arange", 0, 0, 7e4)]
    test_6_casting_twice_equals_casting_once.hypothesis.inner_test(
        _shrunk(steps), "auto_mixed_conservative"
    )


def test_found_a_clamp_to_a_band_below_the_subnormals_before_a_norm():
    """``clamp(x, -1e-9, 1e-9)`` then a layer norm: both bounds were clamped to +-2**-24,
    and the norm carried the 60x; only a clamp's positive minimum guards now."""
    steps = [("clamp", 0, 0, 1e-09), ("layer_norm", 1, 0, 1e-09)]
    test_4_outputs_agree_with_fp32_within_the_float_oracle.hypothesis.inner_test(
        _shrunk(steps), "always_fp16"
    )


def test_found_a_sentinel_added_before_an_explicit_fp32_norm():
    """fp32 squares x + 1e38 to inf inside the norm and gives 0; the cast's stable norm
    (the row scaled by a power of two first) gives 1, the norm of a constant row, as
    fp64 does. The oracle held it to fp32's artifact (fixed in fx16.testing.oracle: where
    fp32 lies beyond the bound of the program run in fp64, the fp64 result counts)."""
    steps = [("scalar_add", 0, 0, 1e38), ("explicit_fp32_norm", 1, 0, 1e-09)]
    test_4_outputs_agree_with_fp32_within_the_float_oracle.hypothesis.inner_test(
        _shrunk(steps), "always_fp16"
    )


def test_generator_keeps_cond_operands_apart_and_batches_above_two():
    """Invalid programs the fuzzer drew at first (fixed in the generator): cond operands
    aliasing each other, and a dynamic batch of 2 that export specializes around cond."""
    x, ids = torch.randn(3, 2), torch.randint(0, 16, (3, 2))
    for steps, dynamic in (
        ([("transpose", 0, 0, 1.0), ("cond", 0, 1, 1.0)], False),
        ([("cond", 0, 0, 1.0)], True),
    ):
        torch.manual_seed(0)
        case = ProgramCase(RandomProgram(2, steps, []).eval(), (x, ids), dynamic, False, 1.0)
        test_6_casting_twice_equals_casting_once.hypothesis.inner_test(case, "always_fp16")


def test_generator_feeds_copies_of_a_loop_result_to_map_and_cond():
    """torch 2.13's export fails to map over, or cond on, a while_loop's result directly
    (the generator passes copies); the loop and the map or cond are cast inside."""
    x, ids = torch.randn(3, 4), torch.randint(0, 16, (3, 4))
    loop_then_map = [("linear", 0, 0, 1.0), ("while_loop", 1, 0, 2.0), ("map", 2, 1, 1.0)]
    loop_then_cond = [("abs", 0, 0, 1e-09), ("while_loop", 0, 0, 1e-09), ("cond", 2, 0, 1e-09)]
    for steps, dynamic in itertools.product((loop_then_map, loop_then_cond), (False, True)):
        torch.manual_seed(0)
        case = ProgramCase(RandomProgram(4, steps, []).eval(), (x, ids), dynamic, False, 1.0)
        test_1_2_cast_never_raises_and_leaves_a_valid_program.hypothesis.inner_test(
            case, "cast_fp32_to_fp16"
        )
        test_6_casting_twice_equals_casting_once.hypothesis.inner_test(case, "auto_mixed_bf16")


def test_generator_draws_custom_ops_through_every_property():
    """The menu's custom ops (activation quantize/dequantize, an op with a dtype argument,
    one given a scalar beyond fp16's range) keep properties 1, 2, 4 and 6 in both dialects."""
    x, ids = torch.randn(3, 4), torch.randint(0, 16, (3, 4))
    steps = [
        ("quantize_dequantize", 0, 0, 1.0),
        ("custom_dtype_argument", 1, 0, 0.5),
        ("custom_dtype_argument", 2, 0, 1e6),
        ("linear", 3, 0, 1.0),
    ]
    entries = ("cast_to_16_bit_precision", "auto_mixed_bf16", "always_fp16")
    for decompose, entry in itertools.product((False, True), entries):
        torch.manual_seed(0)
        case = ProgramCase(RandomProgram(4, steps, []).eval(), (x, ids), False, decompose, 1.0)
        for prop in (
            test_1_2_cast_never_raises_and_leaves_a_valid_program,
            test_4_outputs_agree_with_fp32_within_the_float_oracle,
            test_6_casting_twice_equals_casting_once,
        ):
            prop.hypothesis.inner_test(case, entry)


def _write_into_the_source_of_an_fp64_region(scale: float) -> None:
    """The long fuzz's shrunk program: abs, abs, ``(x.double() * scale).float()``, then a
    cast of a fresh value, a write in place into it (``h.add_(y)``), both read; cast
    under always_fp16 and checked by the float oracle."""
    steps = [("abs", 0, 0, 1e-09), ("abs", 0, 0, 1e-09), ("fp64_region", 0, 0, scale)]
    torch.manual_seed(0)
    model = RandomProgram(2, [*steps, ("write_into_source", 0, 3, 1e-09)], []).eval()
    x = torch.tensor([[0.6577, 0.9387], [1.1317, -0.6455], [-1.7703, 0.2143]])
    ids = torch.tensor([[9, 10], [10, 15], [8, 1]])
    case = ProgramCase(model, (x, ids), dynamic=False, decompose=False, input_scale=1.0)
    test_4_outputs_agree_with_fp32_within_the_float_oracle.hypothesis.inner_test(
        case, "always_fp16"
    )


def test_found_a_write_in_place_beyond_16_bit_into_a_narrowed_value():
    """``h = x * 1`` (16-bit), then ``h.add_(y)`` with y up to 1.2e5 (the fp64 region's
    output): the add gave inf. The op that made h now computes in fp32."""
    _write_into_the_source_of_an_fp64_region(70000.0)


def test_found_a_write_into_the_source_of_a_tiny_fp64_region():
    """The region's output is x * 1e-9: 7% off fp32's, beyond the float oracle's bound,
    while the written value's consumers read a 16-bit copy made before the write; they
    read the value itself now."""
    _write_into_the_source_of_an_fp64_region(1e-09)


def test_6_found_a_body_reading_a_conversion_through_an_identity_op():
    """Long-fuzz finding: ``map`` read ``to_1 * 1.0``, where ``to_1`` is the model's
    conversion out of an fp64 region; cleanup removed the ``* 1.0``, and the next cast's
    PreserveCopiesPass pinned ``to_1`` as a ``_to_copy`` (a body reads it): a second cast
    changed the program. Cleanup keeps such an op now."""
    case = _shrunk([("fp64_region", 0, 0, 1e-9), ("abs", 0, 0, 1e-9), ("map", 1, 0, 1e-9)])
    for entry in ("cast_int32_to_int16", "auto_mixed_bf16", "cast_fp32_to_fp16"):
        ep = _cast(case, entry)
        once = state_snapshot(ep)
        ENTRY_POINTS[entry](ep, case)
        assert_same_state(once, state_snapshot(ep))


def test_6_found_a_kept_norm_after_an_autocast_off_region_stabilized_on_the_second_cast():
    """A model's fp32 RMSNorm after an ``autocast(enabled=False)`` region, kept fp32 by
    auto_mixed_bf16 and so left unrewritten; on a second cast its opening no longer read
    as the model's own, and StabilizePass rewrote the decided norm (fixed there: a
    pattern whose result an earlier cast decided is left as it is)."""
    steps = [("abs", 0, 0, 1e-09)] * 4
    steps += [("autocast_off", 0, 0, 1e-09), ("explicit_fp32_norm", 0, 0, 1e-09)]
    case = _shrunk(steps)
    case.decompose = True
    test_6_casting_twice_equals_casting_once.hypothesis.inner_test(case, "auto_mixed_bf16")


def test_found_a_reader_of_a_models_fp32_cast_of_a_value_fx16_cast_back():
    """x beyond fp16 keeps a custom op's result fp32, with a 16-bit copy for its
    readers; the model's ``.to(float32)`` of that result opens an fp32 region, and an add
    outside it was planned to read the 16-bit copy, but was wired to the fp32 value: it
    computed fp32 where its meta said fp16 (fixed in InsertFP16CastsPass: the redirect
    finds the copy's fp32 source)."""
    steps = [("abs", 0, 0, 1e-09), ("custom_dtype_argument", 0, 0, 1e-09)]
    steps += [("abs", 0, 0, 1e-09), ("abs", 2, 0, 1e-09), ("abs", 0, 0, 1e-09)]
    steps += [("explicit_fp32_norm", 20, 0, 1e-09), ("add", 16, 18, 1e-09)]
    case = _shrunk(steps)
    case.args = (case.args[0] * 1e5, case.args[1])
    test_1_2_cast_never_raises_and_leaves_a_valid_program.hypothesis.inner_test(
        case, "cast_fp32_to_fp16"
    )
