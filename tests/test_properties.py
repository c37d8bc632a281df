"""Property tests: random MLP and attention programs with extreme scalars."""

import pytest
import torch
from fuzz_profile import SLOW_EXAMPLES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fx16
from fx16.pipelines import run_passes
from fx16.testing.strategies import model_cases
from helpers import assert_same_state, check_program, export, run, state_snapshot

SETTINGS = settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _finite_where_fp32_is(reference, outputs):
    for expected, got in zip(reference, outputs):
        if expected.is_floating_point():
            # values fp32 itself holds as infinity-like sentinels (|v| >= 1e38) may saturate
            ordinary = torch.isfinite(expected) & (expected.abs() < 1e38)
            assert torch.isfinite(got[ordinary]).all(), "fx16 introduced inf/nan"


@SETTINGS
@given(model_cases, st.booleans())
def test_cast_is_valid_idempotent_and_adds_no_inf_or_nan(case, decompose):
    model, args = case
    ep = export(model, *args, decompose=decompose)
    with torch.no_grad():
        reference = [t for t in torch.utils._pytree.tree_leaves(ep.module()(*args))]
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    _finite_where_fp32_is(reference, run(ep, *args))
    once = state_snapshot(ep)
    assert not run_passes(fx16.fp16_passes(ep), ep.graph_module)
    assert_same_state(once, state_snapshot(ep))


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_cases, st.booleans())
def test_many_more_random_programs(case, decompose):
    """The same property on more programs (FX16_FUZZ=long for a long run)."""
    test_cast_is_valid_idempotent_and_adds_no_inf_or_nan.hypothesis.inner_test(case, decompose)
