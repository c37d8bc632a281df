"""InsertFP16CastsPass on its own (after the two converters, before cleanup)."""

import math
import operator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from fx16.analysis import ExplicitFp32Analysis, Fp32RulesAnalysis
from fx16.decisions import PRECISION, Reason
from fx16.passes import ConvertParametersPass, ConvertUserInputsPass, InsertFP16CastsPass
from fx16.pipelines import run_passes
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.program.casts import INSERTED
from fx16.testing.checks import check_outputs
from helpers import check_program, export, fp64_reference, inserted_casts, max_error, run, targets
from models import MLP, CreationOps, OverflowWeight

aten = torch.ops.aten


def _analyses(program, policy, forced=frozenset()):
    """The analyses the inserter reads, without calibration or ranges."""
    return [
        Fp32RulesAnalysis.needing_nothing(policy.low, 65504 / 2, fallback=forced),
        ExplicitFp32Analysis(program, policy),
    ]


def _insert(ep, explicit_fp32="keep"):
    program = Program(ep)
    policy = PrecisionPolicy.custom(explicit_fp32=explicit_fp32)
    stages = [*_analyses(program, policy), ConvertParametersPass(program)]
    run_passes([*stages, ConvertUserInputsPass(program)], ep.graph_module)
    result = InsertFP16CastsPass(program, policy=policy)(ep.graph_module)
    ep.graph_module.recompile()
    return result


def _only(ep, target):
    nodes = [n for n in ep.graph_module.graph.nodes if n.target == target]
    assert len(nodes) == 1, nodes
    return nodes[0]


class Scale(torch.nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return (x * self.factor).relu()


def test_all_fp16_graph_needs_no_casts():
    """x -> linear -> gelu -> linear (all f16): no cast inserted, every op f16."""
    ep = export(MLP(), torch.randn(2, 8))
    assert _insert(ep).modified
    assert inserted_casts(ep) == []
    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function":
            assert node.meta["val"].dtype == torch.float16
            assert node.meta[PRECISION].reason == Reason.FITS


def test_scalar_beyond_fp16_keeps_the_op_in_fp32():
    """x:f16 -> mul(x, 1e5) -> relu   becomes   x -> to(f32) -> mul -> to(f16) -> relu."""
    ep = export(Scale(1e5), torch.randn(3))
    _insert(ep)
    mul = _only(ep, aten.mul.Tensor)
    assert mul.meta["val"].dtype == torch.float32
    assert mul.meta[PRECISION].reason == Reason.SCALAR_OVERFLOW
    (upcast,) = mul.all_input_nodes
    assert upcast.target == aten._to_copy.default and upcast.meta[INSERTED] == "upcast"
    (back,) = mul.users
    assert back.meta[INSERTED] == "cast-back" and back.kwargs["dtype"] == torch.float16
    assert _only(ep, aten.relu.default).args[0] is back
    assert targets(ep)[aten._to_copy.default] == 2


@pytest.mark.parametrize("scalar", [0.1, 1 / 0.18215, 1e-6, 3e-5, 65504.0, -7.0, 1e-9])
def test_scalars_keep_the_value_eager_applies(scalar):
    """A 16-bit op takes a Python scalar in its fp32 op math, as eager ``.half()`` does:
    the scalar is written unrounded (``z / 0.18215`` divides by fp32's 0.18215, not
    fp16's nearest 0.18212890625), subnormal-range ones (an RMSNorm's eps) included,
    and the result equals eager fp16's bit for bit. A multiplier below the subnormals
    (1e-9) is not clamped: clamped to 6e-8, the long fuzz found ``x * 1e-9`` 60 times too
    large."""
    ep = export(Scale(scalar), torch.randn(3))
    _insert(ep)
    mul = _only(ep, aten.mul.Tensor)
    assert mul.args[1] == scalar and mul.meta["val"].dtype == torch.float16
    assert mul.meta[PRECISION].reason == Reason.FITS
    x = torch.randn(3, generator=torch.Generator().manual_seed(0)).half()
    ep.graph_module.recompile()
    assert torch.equal(ep.module()(x), Scale(scalar).half()(x))


def test_inf_like_scalar_saturates_instead_of_forcing_fp32():
    ep = export(Scale(-3.0e38), torch.randn(3))
    _insert(ep)
    mul = _only(ep, aten.mul.Tensor)
    assert mul.args[1] == -65504.0
    assert mul.meta["val"].dtype == torch.float16


def test_overflowing_weight_gets_upcast_and_cast_back():
    """fc(x) * 1e-5 * big:f32 + tiny   runs the mul with big in fp32, then returns to fp16."""
    model = OverflowWeight()
    x = torch.randn(2, 4)
    ep = export(model, x)
    _insert(ep)
    check_program(ep)
    muls = [n for n in ep.graph_module.graph.nodes if n.target == aten.mul.Tensor]
    big_mul = next(n for n in muls if any(a.name == "p_big" for a in n.all_input_nodes))
    assert big_mul.meta[PRECISION].reason == Reason.FP32_INPUT
    assert big_mul.meta["val"].dtype == torch.float32
    assert max_error(fp64_reference(model, x), run(ep, x)) < 1e-2


def test_creation_ops_get_dtype_fp16():
    ep = export(CreationOps(), torch.randn(2, 5))
    _insert(ep)
    check_program(ep)
    for target in (
        aten.arange.default,
        aten.zeros.default,
        aten.full.default,
        aten.ones_like.default,
        aten.scalar_tensor.default,
    ):
        node = _only(ep, target)
        assert node.kwargs["dtype"] == torch.float16, target
        assert node.meta["val"].dtype == torch.float16


def test_creation_op_with_out_of_range_fill_stays_fp32():
    ep = export(CreationOps(fill=1e5), torch.randn(2, 5))
    _insert(ep)
    check_program(ep)
    full = _only(ep, aten.full.default)
    assert full.meta["val"].dtype == torch.float32
    assert full.meta[PRECISION].reason == Reason.SCALAR_OVERFLOW
    assert _only(ep, aten.arange.default).kwargs["dtype"] == torch.float16


class TinyFills(torch.nn.Module):
    """Two tensors filled below fp16's smallest subnormal (6e-8): one returned as it is,
    one added to the divisor of ``x / |x|`` as a guard."""

    def forward(self, x):
        value = torch.full((2, 5), 1e-9)
        guard = torch.full((2, 5), 1e-12)
        return value, x / (x.abs() + guard)


class ScaledByFill(torch.nn.Module):
    def __init__(self, fill):
        super().__init__()
        self.fill = fill

    def forward(self, x):
        return x * torch.full((5,), self.fill)


def test_a_fill_below_the_subnormals_rounds_to_nearest_unless_it_is_added_as_a_guard():
    """A filled tensor is made the way eager makes it in fp16: the fill rounds to the
    nearest fp16 value, 0 for 1e-9 (clamped to 2**-24 it would be 60 times the fp32
    value; the long fuzz found that on an output), and the decision says it flushed. A
    fill an add reads is a guard, clamped to the smallest subnormal like a scalar
    ``+ 1e-12``, so a zero divisor stays nonzero."""
    x = torch.tensor([[0.0, 1.0, -2.0, 3.0, 0.5]] * 2)
    ep = export(TinyFills(), x)
    _insert(ep)
    check_program(ep)
    value, guarded = run(ep, x)
    assert value.dtype == torch.float16 and torch.equal(value, torch.zeros(2, 5).half())
    assert torch.equal(guarded.float(), torch.tensor([[0.0, 1.0, -1.0, 1.0, 1.0]] * 2))
    filled, guard = (
        node for node in ep.graph_module.graph.nodes if node.target == aten.full.default
    )
    assert filled.args[1] == 1e-9  # kept as written; the fp16 kernel rounds it
    assert filled.meta[PRECISION].reason == Reason.FITS
    assert filled.meta[PRECISION].detail == "flushed to zero: 1e-09 -> 0"
    assert guard.args[1] == 2.0**-24
    assert guard.meta[PRECISION].reason == Reason.SCALAR_CLAMPED
    assert guard.meta[PRECISION].detail == "1e-12 -> 5.96e-08"


def test_a_fill_at_half_the_smallest_subnormal_flushes_and_just_above_it_does_not():
    """Round half to even: 2**-25 is halfway between 0 and 2**-24 and rounds to 0."""
    for fill, expected in ((2.0**-25, 0.0), (2.0**-25 * 1.0001, 2.0**-24), (1e-7, 2.0**-23)):
        ep = export(ScaledByFill(fill), torch.randn(2, 5))
        _insert(ep)
        full = _only(ep, aten.full.default)
        assert full.meta["val"].dtype == torch.float16
        flushed = full.meta[PRECISION].detail.startswith("flushed to zero")
        assert flushed == (expected == 0.0), fill
        made = torch.full((1,), full.args[1], dtype=torch.float16)
        assert made.item() == expected, fill


class ExplicitDtype(torch.nn.Module):
    def forward(self, x):
        return x.softmax(-1, dtype=torch.float32) + x.sum(-1, keepdim=True, dtype=torch.float32)


@pytest.mark.parametrize("keep", [True, False])
def test_dtype_arguments(keep):
    """softmax(x, dtype=f32): kept as an fp32 request, or rewritten to f16 when not kept."""
    ep = export(ExplicitDtype(), torch.randn(2, 4))
    _insert(ep, explicit_fp32="keep" if keep else "retarget")
    check_program(ep)
    softmax = _only(ep, aten.softmax.int)
    expected = torch.float32 if keep else torch.float16
    assert softmax.args[2] == expected
    assert softmax.meta["val"].dtype == expected
    assert _only(ep, aten.sum.dim_IntList).kwargs["dtype"] == expected


class Island(torch.nn.Module):
    """r = relu(x); h = x.float(); y = h.exp() / h.exp().sum(); return y.to(f32) * r.

    (r comes first: an identity ``x.to(torch.float32)`` returns x itself, so export
    routes every later use of x through the cast.)"""

    def forward(self, x):
        r = x.relu()
        h = x.to(torch.float32)
        y = h.exp() / h.exp().sum(-1, keepdim=True)
        return y.to(torch.float32) * r


def test_explicit_fp32_region_and_its_exit():
    """Ops fed only by the model's own to(f32) stay f32 without cast-backs; the next to(f32)
    of that region becomes to(f16), so the product runs in fp16 again."""
    ep = export(Island(), torch.randn(2, 3))
    _insert(ep)
    check_program(ep)
    first, second = [n for n in ep.graph_module.graph.nodes if n.target == aten.to.dtype]
    assert first.args[1] == torch.float32 and first.meta[PRECISION].reason == Reason.EXPLICIT_FP32
    assert second.args[1] == torch.float16 and second.meta[INSERTED] == "retargeted"
    for target in (aten.exp.default, aten.div.Tensor, aten.sum.dim_IntList):
        for node in (n for n in ep.graph_module.graph.nodes if n.target == target):
            assert node.meta["val"].dtype == torch.float32
    assert _only(ep, aten.mul.Tensor).meta["val"].dtype == torch.float16
    assert inserted_casts(ep) == [second]


@pytest.mark.parametrize("cast_again", [False, True])
def test_decomposed_region_is_read_from_its_assertions(cast_again):
    """run_decompositions drops Island's no-op to(f32) casts and leaves their
    _assert_tensor_metadata checks: the region and its exit are rebuilt from those."""
    ep = export(Island(), torch.randn(2, 3), decompose=True)
    assert not [n for n in ep.graph_module.graph.nodes if n.target in (aten.to.dtype,)]
    _insert(ep)
    if cast_again:
        assert not _insert(ep).modified
    check_program(ep)
    opening, closing = inserted_casts(ep)
    assert opening.kwargs["dtype"] == torch.float32 and opening.meta[INSERTED] == "upcast"
    assert opening.meta[PRECISION].reason == Reason.EXPLICIT_FP32
    assert closing.kwargs["dtype"] == torch.float16
    for target in (aten.exp.default, aten.div.Tensor, aten.sum.dim_IntList):
        for node in (n for n in ep.graph_module.graph.nodes if n.target == target):
            assert node.meta[PRECISION].reason == Reason.EXPLICIT_FP32
    assert _only(ep, aten.mul.Tensor).meta["val"].dtype == torch.float16
    assert _only(ep, aten.relu.default).meta["val"].dtype == torch.float16
    x = torch.randn(2, 3)
    assert max_error(fp64_reference(Island(), x), run(ep, x)) < 2e-3


class NotARegion(torch.nn.Module):
    """GPT-2's ``attn_weights.type(value.dtype)`` with fp32 values: no sensitive op follows."""

    def forward(self, x, v):
        weights = x.softmax(-1).type(v.dtype)
        return weights @ v


def test_decomposed_assertion_without_a_sensitive_op_adds_nothing():
    ep = export(NotARegion(), torch.randn(2, 3, 3), torch.randn(2, 3, 3), decompose=True)
    assert targets(ep)[aten._assert_tensor_metadata.default] == 1
    _insert(ep)
    check_program(ep)
    assert not inserted_casts(ep)
    assert all(
        n.meta["val"].dtype == torch.float16
        for n in ep.graph_module.graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
    )


class IntToFloat(torch.nn.Module):
    def forward(self, x, ids):
        return x + ids.to(torch.float32)


def test_integer_to_fp32_cast_is_retargeted_to_fp16():
    ep = export(IntToFloat(), torch.randn(3), torch.arange(3))
    _insert(ep)
    cast = _only(ep, aten.to.dtype)
    assert cast.args[1] == torch.float16
    assert _only(ep, aten.add.Tensor).meta["val"].dtype == torch.float16


class MaxAndNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        values, indices = self.norm(x).max(-1)
        return values, indices


@pytest.mark.parametrize("decompose", [False, True])
def test_multi_output_ops_and_getitem_meta(decompose):
    ep = export(MaxAndNorm(), torch.randn(3, 4), decompose=decompose)
    _insert(ep)
    check_program(ep)
    values, indices = ep.graph_module.graph.output_node().args[0]
    assert values.meta["val"].dtype == torch.float16
    assert indices.meta["val"].dtype == torch.int64
    for node in ep.graph_module.graph.nodes:
        if node.target == aten.native_layer_norm.default:
            # mean/rstd dtypes come from the op itself, not from a blanket rewrite
            expected = [
                t.dtype
                for t in torch.ops.aten.native_layer_norm(
                    torch.randn(3, 4).half(), [4], torch.ones(4).half(), torch.zeros(4).half(), 1e-5
                )
            ]
            assert [t.dtype for t in node.meta["val"]] == expected
        if node.target is operator.getitem:
            assert node.meta["val"] is node.args[0].meta["val"][node.args[1]]


def test_assert_tensor_metadata_follows_the_value():
    ep = export(Island(), torch.randn(2, 3))
    _insert(ep)
    for node in ep.graph_module.graph.nodes:
        if node.target == aten._assert_tensor_metadata.default:
            assert node.kwargs["dtype"] == node.args[0].meta["val"].dtype


class SharedUpcast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.big = torch.nn.Parameter(torch.tensor([1e5, 2.0, 3.0]))

    def forward(self, x):
        h = x.relu()
        return h * self.big, h + self.big, h - self.big


def test_one_upcast_per_producer():
    """h:f16 feeds three fp32 ops: one to(f32) of h serves all three."""
    ep = export(SharedUpcast(), torch.randn(3))
    _insert(ep)
    check_program(ep)
    upcasts = [n for n in inserted_casts(ep) if n.meta[INSERTED] == "upcast"]
    assert len(upcasts) == 1 and len(upcasts[0].users) == 3


def test_output_specs_follow_cast_backs():
    ep = export(Scale(1e5), torch.randn(3))
    _insert(ep)
    returned = ep.graph_module.graph.output_node().args[0]
    assert [s.arg.name for s in ep.graph_signature.output_specs] == [n.name for n in returned]


def test_second_run_reports_no_change():
    ep = export(OverflowWeight(), torch.randn(2, 4))
    _insert(ep)
    code = ep.graph_module.code
    assert not InsertFP16CastsPass(Program(ep))(ep.graph_module).modified
    ep.graph_module.recompile()
    assert ep.graph_module.code == code


def test_opaque_higher_order_region_is_fed_fp32():
    class Region(torch.nn.Module):
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                s = x.exp().sum(-1, keepdim=True)
            return x / s

    ep = export(Region(), torch.randn(2, 4))
    _insert(ep)
    check_program(ep)
    hop = next(
        n
        for n in ep.graph_module.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator)
    )
    assert hop.meta[PRECISION].reason == Reason.AUTOCAST_DISABLED
    assert all(
        a.meta["val"].dtype == torch.float32
        for a in hop.all_input_nodes
        if isinstance(a.meta.get("val"), torch.Tensor)
    )


@settings(max_examples=30, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=True, width=32))
def test_any_scalar_keeps_the_program_valid(factor):
    ep = export(Scale(factor), torch.randn(3))
    _insert(ep)
    check_program(ep)
    mul = _only(ep, aten.mul.Tensor)
    magnitude, sentinel = abs(factor), float(torch.tensor(1e38))  # 1e38 as fp32 holds it
    if 65504 < magnitude < sentinel:  # beyond fp16, no sentinel: the op stays fp32
        assert mul.meta["val"].dtype == torch.float32 and mul.args[1] == factor
        return
    assert mul.meta["val"].dtype == torch.float16
    if sentinel <= magnitude < math.inf:  # a sentinel: saturated
        assert mul.args[1] == math.copysign(65504.0, factor)
    else:  # as eager applies it, in fp32 op math (a tiny multiplier too: not clamped)
        assert mul.args[1] == factor


class TypeAsValue(torch.nn.Module):
    """GPT-2's attention: softmax(scores).type(value.dtype) @ value - fp32 only at export."""

    def forward(self, scores, value):
        weights = scores.softmax(-1).type(value.dtype)
        return torch.nn.functional.dropout(weights, 0.1, False) @ value


def test_an_fp32_cast_before_nothing_sensitive_is_not_a_region():
    """softmax -> to(f32) -> dropout -> matmul(value:f16): the cast becomes to(f16), all fp16."""
    ep = export(TypeAsValue(), torch.randn(2, 4, 4), torch.randn(2, 4, 3))
    _insert(ep)
    check_program(ep)
    cast = _only(ep, aten.to.dtype)
    assert cast.args[1] == torch.float16
    assert _only(ep, aten.matmul.default).meta["val"].dtype == torch.float16
    assert not [n for n in inserted_casts(ep) if n.meta[INSERTED] == "upcast"]


def test_an_fp32_cast_before_a_variance_is_a_region():
    """RMSNorm: to(f32) -> pow -> mean: kept in fp32 (see Island above for the exit)."""
    ep = export(Island(), torch.randn(2, 3))
    _insert(ep)
    first = [n for n in ep.graph_module.graph.nodes if n.target == aten.to.dtype][0]
    assert first.meta[PRECISION].reason == Reason.EXPLICIT_FP32


class TwoReaders(torch.nn.Module):
    def forward(self, x):
        return x.exp(), x.sin()


def test_an_input_kept_fp32_by_the_budget_is_read_in_fp16_by_its_other_consumers():
    ep = export(TwoReaders(), torch.randn(4, 8))
    program = Program(ep)
    forced = frozenset({"x", "exp"})
    policy = PrecisionPolicy.default()
    run_passes(
        [
            *_analyses(program, policy, forced),
            ConvertUserInputsPass(program, policy=policy, force_fp32=forced),
            InsertFP16CastsPass(program, policy=policy, force_fp32=forced),
        ],
        ep.graph_module,
    )
    check_program(ep)
    exp, sin = _only(ep, aten.exp.default), _only(ep, aten.sin.default)
    assert exp.args[0].op == "placeholder"  # the forced use reads the unrounded input
    assert exp.meta[PRECISION].reason == Reason.ACCURACY_FALLBACK
    assert sin.args[0].meta[INSERTED] and sin.args[0].meta["val"].dtype == torch.float16
    assert sin.meta[PRECISION].dtype == torch.float16
    x = torch.randn(4, 8)
    got_exp, got_sin = run(ep, x)
    assert torch.equal(got_exp, x.exp().half())  # computed in fp32, then rounded once
    assert torch.allclose(got_sin.float(), x.sin(), atol=2e-3)


class ClampedToFp32Range(torch.nn.Module):
    """A linear layer's output clamped to fp32's range, and a tensor filled with fp32's
    lowest value: ``finfo(float32).min`` / ``.max`` are sentinels, beyond 16-bit."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        info = torch.finfo(torch.float32)
        h = self.fc(x)
        return h.clamp(info.min, info.max), torch.full_like(h, info.min)


@pytest.mark.parametrize("policy", ["autocast", "auto_mixed_bf16", "always_fp16"])
def test_an_op_that_follows_a_16_bit_input_saturates_its_sentinel_scalars(policy):
    """Under a policy whose elementwise ops follow their inputs, the clamp and the
    full_like run in the linear layer's 16-bit dtype: their fp32 sentinels become the
    16-bit maximum (``clamp`` of a bf16 tensor to -3.4028e38 raised at run time; found by
    the fuzzer)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    model = ClampedToFp32Range()
    ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy)
    check_program(ep)
    low = PrecisionPolicy.named(policy).low
    top = torch.finfo(low).max
    nodes = {n.target: n for n in ep.graph_module.graph.nodes if n.op == "call_function"}
    clamp = nodes[torch.ops.aten.clamp.default]
    full = nodes[torch.ops.aten.full_like.default]
    assert clamp.meta["val"].dtype == low and clamp.args[1:] == (-top, top)
    assert full.meta["val"].dtype == low and full.args[1] == -top
    clamped, filled = run(ep, x.to(ep.example_inputs[0][0].dtype))
    expected = model(x)[0]
    assert torch.allclose(clamped.float(), expected, atol=3e-2, rtol=3e-2)
    assert bool((filled.float() == -top).all())


class ClampedInCond(torch.nn.Module):
    """The same sentinels inside the branches of a ``torch.cond``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        info = torch.finfo(torch.float32)

        def clamped(h):
            return h.clamp(info.min, info.max)

        def filled(h):
            return torch.full_like(h, info.min)

        h = self.fc(x)
        return torch.cond(h.sum() > 0, clamped, filled, (h,))


def test_sentinels_saturate_inside_a_cond_body_too():
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    ep = fx16.cast_fp32_to_fp16(export(ClampedInCond(), x), policy="autocast")
    check_program(ep)
    top = torch.finfo(torch.bfloat16).max
    body_nodes = [
        node
        for module in ep.graph_module.modules()
        if isinstance(module, torch.fx.GraphModule) and module is not ep.graph_module
        for node in module.graph.nodes
        if node.target in (aten.clamp.default, aten.full_like.default)
    ]
    assert len(body_nodes) == 2
    for node in body_nodes:
        assert node.meta["val"].dtype == torch.bfloat16
        assert -top in node.args[1:]
    run(ep, x.to(ep.example_inputs[0][0].dtype))


class TinyFillsInBranches(torch.nn.Module):
    def forward(self, x):
        return torch.cond(
            x.sum() > 0,
            lambda a: a * torch.full((5,), 1e-9),
            lambda a: a + torch.full((5,), 1e-12),
            (x,),
        )


def test_a_tiny_fill_inside_a_cond_branch_is_judged_as_in_the_root_graph():
    """The branch calibration ran multiplies by a fill of 1e-9: observed below fp16's
    normal range, the fill and the product compute in fp32 and the cond returns fp32
    (once: flushed to zero, all zeros out); the branch it never ran adds a fill of
    1e-12, clamped to the smallest subnormal (a guard)."""
    ep = fx16.cast_fp32_to_fp16(export(TinyFillsInBranches(), torch.ones(2, 5)))
    fills = {
        name: node
        for name, module in ep.graph_module.named_modules()
        for node in getattr(module, "graph", torch.fx.Graph()).nodes
        if node.target == aten.full.default
    }
    assert fills["true_graph_0"].args[1] == 1e-9
    assert fills["true_graph_0"].meta[PRECISION].reason == Reason.ACTIVATION_BELOW_RANGE
    assert fills["false_graph_0"].args[1] == 2.0**-24
    assert fills["false_graph_0"].meta[PRECISION].reason == Reason.SCALAR_CLAMPED
    assert torch.equal(run(ep, torch.ones(2, 5))[0], torch.full((2, 5), 1e-9))


class TinyScalar(torch.nn.Module):
    def __init__(self, apply) -> None:
        super().__init__()
        self.apply_scalar = apply

    def forward(self, x):
        return self.apply_scalar(x)


TINY = 1e-9  # below fp16's smallest subnormal, 2**-24


@pytest.mark.parametrize(
    "apply, guarded",
    [
        (lambda x: torch.clamp(x, min=TINY), True),  # a positive minimum keeps x above zero
        (lambda x: torch.clamp_min(x, TINY), True),
        (lambda x: x + TINY, True),  # an eps added
        (lambda x: x - (-TINY), True),
        (lambda x: torch.clamp(x, max=TINY), False),  # a maximum guards nothing
        (lambda x: torch.clamp(x, min=-TINY), False),  # nor a negative minimum
        (lambda x: x - TINY, False),
        (lambda x: x + (-TINY), False),
    ],
)
def test_only_a_scalar_that_keeps_a_result_above_zero_is_clamped_to_the_subnormals(apply, guarded):
    """A tiny scalar that guards (an eps added, a clamp's positive minimum) becomes
    2**-24 rather than flushing; any other one is kept as eager applies it, and the 16-bit
    kernel rounds the result (a clamp to [-1e-9, 1e-9] gives zeros, not +-6e-8)."""
    x = torch.tensor([[0.5, -0.25, 0.0, 3.0]])
    ep = export(TinyScalar(apply), x)
    fx16.cast_fp32_to_fp16(ep, policy="always_fp16", scalars="keep")  # numbers stay args
    (op,) = [
        n
        for n in ep.graph_module.graph.nodes
        if n.meta.get(PRECISION) is not None and n.op == "call_function"
    ]
    scalars = [a for a in (*op.args[1:], *op.kwargs.values()) if isinstance(a, float)]
    assert (op.meta[PRECISION].reason == Reason.SCALAR_CLAMPED) == guarded
    assert any(abs(s) == 2.0**-24 for s in scalars) == guarded
    assert not guarded or "1e-09 -> " in op.meta[PRECISION].detail  # said, with its sign


def test_a_clamp_to_a_band_below_the_subnormals_gives_fp32s_band():
    """The long fuzz's example: clamp to [-1e-9, 1e-9], then a layer norm (which divides
    by sqrt(var + eps), so a 60x larger clamp came out 60x larger). The band lies below
    fp16's normal range on the calibration input, so it is computed and returned in
    fp32 (once: zeros, 16-bit's rounding of it), within the float oracle's bound."""

    class BandThenNorm(torch.nn.Module):
        def forward(self, x):
            band = torch.clamp(x, -TINY, TINY)
            return band, torch.nn.functional.layer_norm(band, (2,))

    x = torch.tensor([[0.6577, 0.9387], [1.1317, -0.6455], [-1.7703, 0.2143]])
    original, ep = export(BandThenNorm(), x), export(BandThenNorm(), x)
    fx16.cast_fp32_to_fp16(ep, policy="always_fp16")
    check_outputs(original, ep, (x,))
    band, normed = run(ep, x.half())
    assert torch.equal(band, torch.clamp(x.half().float(), -TINY, TINY))


class TinyClampsInBranches(torch.nn.Module):
    def forward(self, x):
        return torch.cond(
            x.sum() > 0,
            lambda a: torch.clamp(a, -TINY, TINY),
            lambda a: torch.clamp(a, min=TINY),
            (x,),
        )


def test_a_clamp_inside_a_cond_branch_is_guarded_only_by_its_positive_minimum():
    """In a body as in the root graph: the band's bounds are kept, and since the band
    (the branch calibration ran) lies below fp16's normal range it is computed and
    returned in fp32 (once: the kernel rounded it to zeros); the positive minimum of
    the other branch is clamped to 2**-24."""
    ep = fx16.cast_fp32_to_fp16(
        export(TinyClampsInBranches(), torch.ones(2, 5)), policy="always_fp16", scalars="keep"
    )
    clamps = {
        name: node
        for name, module in ep.graph_module.named_modules()
        for node in getattr(module, "graph", torch.fx.Graph()).nodes
        if node.target == aten.clamp.default
    }
    assert clamps["true_graph_0"].args[1:] == (-TINY, TINY)
    assert clamps["false_graph_0"].args[1] == 2.0**-24
    assert clamps["false_graph_0"].meta[PRECISION].reason == Reason.SCALAR_CLAMPED
    assert clamps["true_graph_0"].meta[PRECISION].reason == Reason.ACTIVATION_BELOW_RANGE
    assert torch.equal(run(ep, torch.ones(2, 5).half())[0], torch.full((2, 5), TINY))
