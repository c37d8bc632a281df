"""ScalarsAsConstantsPass: the Python numbers of 16-bit ops as 0-d 16-bit constants."""

import io
import operator

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export.graph_signature import InputKind

import fx16
from fx16.passes import ScalarsAsConstantsPass
from fx16.passes.scalars_as_constants import folded_value
from fx16.program import Program
from helpers import (
    assert_same_state,
    check_program,
    eager,
    export,
    run,
    run_fx16,
    state_snapshot,
)

OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}


class Binary(torch.nn.Module):
    """``op(x, scalar)``: export records the scalar as a Python number of a ``.Tensor`` op."""

    def __init__(self, op: str, scalar) -> None:
        super().__init__()
        self.op, self.scalar = OPS[op], scalar

    def forward(self, x):
        return self.op(x, self.scalar)


class Mixed(torch.nn.Module):
    """Scalars on a 16-bit op, on an fp32 op, beside state, and one value twice."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((4,), 0.5, dtype=torch.float16))
        self.register_buffer("shift", torch.full((4,), 2.0, dtype=torch.float16))

    def forward(self, x, wide):
        h = (x * 0.125 + self.shift) * self.weight
        return h - 0.125, h * 0.1, wide * 0.125, h / 3


def constant_specs(ep) -> dict[str, torch.Tensor]:
    """The constants the pass added, by placeholder name."""
    return {
        spec.arg.name: ep.constants[spec.target]
        for spec in ep.graph_signature.input_specs
        if spec.kind == InputKind.CONSTANT_TENSOR and spec.target.startswith("fx16_scalar_")
    }


def fold(ep, mode: str = "exact"):
    result = ScalarsAsConstantsPass(Program(ep), mode)(ep.graph_module)
    check_program(ep)
    return result


def test_exact_scalars_become_16_bit_constants_after_the_state():
    x, wide = torch.randn(2, 4).half(), torch.randn(2, 4)
    model = Mixed()
    ep = export(model, x, wide)
    assert fold(ep).modified
    constants = constant_specs(ep)
    # 0.125 twice on fp16 ops, 3 once: two constants; 0.1 (inexact) and the fp32 op's 0.125 stay
    assert sorted((float(v), v.dtype, v.dim()) for v in constants.values()) == [
        (0.125, torch.float16, 0),
        (3.0, torch.float16, 0),
    ]
    kinds = [spec.kind for spec in ep.graph_signature.input_specs]
    assert (
        kinds
        == [InputKind.PARAMETER, InputKind.BUFFER]
        + [InputKind.CONSTANT_TENSOR] * 2
        + [InputKind.USER_INPUT] * 2
    )
    scalars_left = sorted(
        arg
        for node in ep.graph.nodes
        if node.op == "call_function"
        for arg in node.args
        if isinstance(arg, float)
    )
    assert scalars_left == [0.1, 0.125]
    for got, want in zip(run(ep, x, wide), eager(model, x, wide)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_program_saves_loads_and_decomposes_with_its_constants():
    x, wide = torch.randn(2, 4).half(), torch.randn(2, 4)
    model = Mixed()
    ep = export(model, x, wide)
    fold(ep)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    decomposed = ep.run_decompositions()
    want = eager(model, x, wide)
    for program in (loaded, decomposed):
        assert len(constant_specs(program)) == 2
        assert all(torch.equal(a, b) for a, b in zip(run(program, x, wide), want))


@pytest.mark.parametrize(
    ("scalar", "dtype", "exact", "rounded"),
    [
        (0.125, torch.float16, 0.125, 0.125),
        (-0.0, torch.float16, -0.0, -0.0),
        (3, torch.float16, 3.0, 3.0),
        (2049, torch.float16, None, 2048.0),  # fp16 holds integers to 2048 exactly
        (0.1, torch.float16, None, 0.0999755859375),
        (65504.0, torch.float16, 65504.0, 65504.0),
        (65520.0, torch.float16, None, None),  # rounds to inf
        (float("-inf"), torch.float16, float("-inf"), float("-inf")),
        (2.0**-14, torch.float16, 2.0**-14, 2.0**-14),  # the smallest normal
        (2.0**-24, torch.float16, 2.0**-24, 2.0**-24),  # a subnormal fp16 holds exactly
        (1e-6, torch.float16, None, None),  # rounds to a subnormal
        (1e-8, torch.float16, None, None),  # rounds to 0
        (float("nan"), torch.float16, None, None),
        (0.1, torch.bfloat16, None, 0.10009765625),
        (1e-30, torch.bfloat16, None, 9.98402083170343e-31),  # bf16's range is fp32's
        (3.4e38, torch.bfloat16, None, None),  # rounds to inf
        (32767, torch.int16, 32767, 32767),
        (-32768, torch.int16, -32768, -32768),
        (32768, torch.int16, None, None),
        (-32769, torch.int16, None, None),
        (1.5, torch.int16, None, None),
        (True, torch.float16, None, None),
    ],
)
def test_which_scalars_fold(scalar, dtype, exact, rounded):
    for mode, want in (("exact", exact), ("rounded", rounded), ("keep", None)):
        got = folded_value(scalar, dtype, mode)
        if want is None:
            assert got is None, (mode, got)
        else:
            assert got.dtype == dtype and got.dim() == 0, mode
            assert got.item() == want and str(got.item()) == str(want), mode  # -0.0 apart


def test_zero_and_negative_zero_are_two_constants():
    class Zeros(torch.nn.Module):
        def forward(self, x):
            return torch.add(x, 0.0, alpha=2), torch.add(x, -0.0, alpha=2)

    x = torch.tensor([-0.0, 0.0, 1.0], dtype=torch.float16)
    ep = export(Zeros(), x)
    fold(ep)
    assert sorted(str(float(v)) for v in constant_specs(ep).values()) == ["-0.0", "0.0"]
    for got, want in zip(run(ep, x), eager(Zeros(), x)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # the signs too


def test_ops_that_compute_in_another_dtype_keep_their_scalars():
    class Promoting(torch.nn.Module):
        def forward(self, x, ids, wide):
            return x * wide, ids * 2, ids * 0.5, x.float() * 0.5

    x, ids, wide = torch.randn(3).half(), torch.arange(3), torch.randn(3)
    ep = export(Promoting(), x, ids, wide)
    assert not fold(ep).modified
    assert constant_specs(ep) == {}


def test_int16_ops_take_int16_constants_that_fit():
    class Shift(torch.nn.Module):
        def forward(self, ids):
            return ids + 7, ids * 40000

    ids = torch.arange(-3, 3, dtype=torch.int16)
    ep = export(Shift(), ids)
    fold(ep)
    values = list(constant_specs(ep).values())
    assert [(int(v), v.dtype) for v in values] == [(7, torch.int16)]
    for got, want in zip(run(ep, ids), eager(Shift(), ids)):
        assert torch.equal(got, want)


def test_a_body_keeps_its_scalars():
    class Branch(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda v: v * 0.5, lambda v: v * 0.25, (x,)) * 2

    x = torch.randn(4).half()
    ep = export(Branch(), x)
    fold(ep)
    assert [float(v) for v in constant_specs(ep).values()] == [2.0]
    for body in (ep.graph_module.true_graph_0, ep.graph_module.false_graph_0):
        assert any(isinstance(a, float) for n in body.graph.nodes for a in n.args)
    assert torch.equal(run(ep, x)[0], eager(Branch(), x))


def test_an_unknown_mode_is_refused_before_anything_changes():
    ep = export(Mixed(), torch.randn(2, 4).half(), torch.randn(2, 4))
    before = state_snapshot(ep)
    with pytest.raises(fx16.InvalidOptionError, match="scalars must be one of"):
        fx16.cast_to_16_bit_precision(ep, scalars="all")
    assert_same_state(before, state_snapshot(ep))


class Scaled(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x * 0.5 + 1.0, approximate="tanh") / 8


def test_the_cast_folds_exact_scalars_and_keeps_every_result():
    x = torch.randn(4, 16) * 3
    folded, kept = export(Scaled(), x), export(Scaled(), x)
    fx16.cast_to_16_bit_precision(folded)
    fx16.cast_to_16_bit_precision(kept, scalars="keep")
    assert {v.dtype for v in constant_specs(folded).values()} == {torch.float16}
    assert constant_specs(kept) == {}
    assert all(torch.equal(a, b) for a, b in zip(run(folded, x), run(kept, x)))


def test_a_failure_after_the_constants_were_added_leaves_the_program_unchanged(monkeypatch):
    x = torch.randn(4, 16)
    ep = export(Scaled(), x)
    before = state_snapshot(ep)
    original = ScalarsAsConstantsPass.call

    def failing(self, graph_module):
        assert original(self, graph_module).modified
        raise RuntimeError("injected failure")

    monkeypatch.setattr(ScalarsAsConstantsPass, "call", failing)
    with pytest.raises(fx16.PassFailedError, match="injected failure"):
        fx16.cast_to_16_bit_precision(ep)
    assert_same_state(before, state_snapshot(ep))
    monkeypatch.undo()
    fx16.cast_to_16_bit_precision(ep)
    assert len(constant_specs(ep)) == 3  # 0.5, 1.0 and 8.0; the tanh GELU's own are inexact


FP16_EXACT = st.builds(
    lambda mantissa, exponent: mantissa * 2.0**exponent,
    st.integers(-2047, 2047),
    st.integers(-24, 5),
)
SCALARS = st.one_of(
    FP16_EXACT,
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.integers(-70000, 70000),
)


@settings(max_examples=examples(40), deadline=None)
@given(
    op=st.sampled_from(sorted(OPS)),
    scalar=SCALARS,
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    mode=st.sampled_from(["exact", "rounded"]),
)
def test_a_folded_scalar_gives_eager_or_its_own_rounding(op, scalar, dtype, mode):
    """Oracle: eager torch on the 16-bit tensor, with the Python number (``exact``)
    or with the number the 16-bit type rounds it to (``rounded``), which must be
    within half an ulp of a normal number."""
    x = torch.cat([torch.randn(16) * 100, torch.tensor([0.0, -0.0, 1.0, 65504.0])]).to(dtype)
    ep = export(Binary(op, scalar), x)
    fold(ep, mode)
    folded = list(constant_specs(ep).values())
    used = float(folded[0]) if folded else scalar
    if folded and mode == "exact":
        assert float(folded[0]) == float(torch.tensor(scalar, dtype=torch.float32))
    if folded and float(folded[0]) != float(torch.tensor(scalar, dtype=torch.float32)):
        unit = 2.0**-11 if dtype == torch.float16 else 2.0**-8
        assert abs(used) >= torch.finfo(dtype).tiny
        assert abs(used - scalar) <= unit * abs(scalar)
    want = Binary(op, used)(x)
    got = run(ep, x)[0]
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)) or (
        got.isnan().equal(want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    )


def test_the_command_line_takes_the_setting(tmp_path):
    source = tmp_path / "scaled.pt2"
    torch.export.save(export(Scaled(), torch.randn(4, 16)), source)
    found = {}
    for setting in ("exact", "keep"):
        target = tmp_path / f"{setting}.pt2"
        result = run_fx16(["cast", source, "-o", target, "--scalars", setting])
        assert result.returncode == 0, result.stderr
        found[setting] = len(constant_specs(torch.export.load(target)))
    assert found == {"exact": 3, "keep": 0}


class RmsNormEps(torch.nn.Module):
    """A Llama-style RMSNorm, which the stable rewrite scales: its eps term multiplies
    1/s, a power of two, by sqrt(eps)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


@settings(max_examples=examples(30), deadline=None)
@given(
    eps=st.sampled_from([1e-5, 1e-6, 1.01e-6, 3e-7, 1e-8]),
    exponent=st.integers(-30, 14),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_the_stable_norm_stores_sqrt_eps_rounded_and_gives_eager_bit_for_bit(eps, exponent, dtype):
    """sqrt(eps) (times 64, the scale's 1/f), which 16-bit does not hold, is a 16-bit
    constant by default (no cast at run time) and every result is the one the Python
    number gives, on rows from silent (the eps term's product subnormal) to loud."""
    torch.manual_seed(exponent)
    x = torch.randn(3, 64) * 2.0**exponent
    x[1] *= 2.0**-12  # a quiet row beside the loud one
    x[2] = 0
    policy = "default" if dtype == torch.float16 else "auto_mixed_bf16"
    folded, kept = export(RmsNormEps(eps), x), export(RmsNormEps(eps), x)
    fx16.cast_fp32_to_fp16(folded, policy=policy, calibration=[])
    fx16.cast_fp32_to_fp16(kept, policy=policy, calibration=[], scalars="keep")
    sqrt_eps = torch.tensor(eps**0.5 * 64, dtype=torch.float32).to(dtype)
    stored = [v for v in constant_specs(folded).values() if v.dtype == dtype]
    normal = float(sqrt_eps.abs()) >= torch.finfo(dtype).tiny
    assert any(float(v) == float(sqrt_eps) for v in stored) == normal
    inputs = fx16.inputs_for(folded, x)[0]
    got, want = run(folded, *inputs)[0], run(kept, *inputs)[0]
    assert got.dtype == want.dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
