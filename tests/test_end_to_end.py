"""cast_fp32_to_fp16 on whole small models: the program stays valid and close to fp64."""

import pytest
import torch

import fx16
from fx16.decisions import PRECISION, Reason
from fx16.program.casts import INSERTED
from fx16.report.rows import decision_rows
from helpers import casts, check_program, export, fp64_reference, max_error, run, targets
from models import (
    MLP,
    BufferUpdate,
    ConvBN,
    EmbeddingNormSoftmax,
    MaskedAttention,
    MixedBuffers,
    RMSNormMLP,
)

aten = torch.ops.aten


def _cast_and_compare(model, args, decompose=False, tolerance=1e-2, **options):
    ep = export(model, *args, decompose=decompose)
    assert fx16.cast_fp32_to_fp16(ep, **options) is ep
    check_program(ep)
    outputs = run(ep, *args)
    assert all(torch.isfinite(o).all() for o in outputs if o.is_floating_point())
    assert max_error(fp64_reference(model, *args), outputs) < tolerance
    return ep, outputs


@pytest.mark.parametrize("decompose", [False, True])
def test_mlp_runs_fully_in_fp16(decompose):
    """x:f32 -> linear -> gelu -> linear   becomes   x:f16 -> ... all f16, no casts."""
    torch.manual_seed(0)
    ep, outputs = _cast_and_compare(MLP(), (torch.randn(4, 8),), decompose)
    assert casts(ep) == []
    assert all(o.dtype == torch.float16 for o in outputs)
    assert all(t.dtype == torch.float16 for t in ep.state_dict.values())


@pytest.mark.parametrize("decompose", [False, True])
def test_cnn_with_batchnorm(decompose):
    torch.manual_seed(0)
    model = ConvBN()
    model.bn.running_var.uniform_(0.5, 2.0)
    ep, outputs = _cast_and_compare(model, (torch.randn(2, 3, 8, 8),), decompose)
    assert outputs[0].dtype == torch.float16
    assert ep.state_dict["bn.running_mean"].dtype == torch.float16


@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min, float("-inf")])
def test_attention_with_large_negative_mask(fill):
    """finfo.min and -inf saturate in fp16; -1e9, far beyond the scores a softmax reads,
    is a sentinel as they are (SentinelFillsPass): all three masked_fills are 16-bit."""
    torch.manual_seed(0)
    keep = torch.tensor([[True, True, True, False], [True, False, False, False]])
    ep, _ = _cast_and_compare(MaskedAttention(fill=fill), (torch.randn(2, 4, 16), keep))
    masked_fill = next(
        n for n in ep.graph_module.graph.nodes if n.target == aten.masked_fill.Scalar
    )
    assert masked_fill.meta["val"].dtype == torch.float16
    assert masked_fill.args[2] in (-65504.0, float("-inf"))


def test_embedding_layernorm_softmax():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 6))
    ep, outputs = _cast_and_compare(EmbeddingNormSoftmax(), (ids,))
    assert outputs[0].dtype == torch.float16
    assert ep.example_inputs[0][0].dtype == torch.int64  # integer inputs are untouched


def _float_ops(ep, target=None):
    return [
        n
        for n in ep.graph_module.graph.nodes
        if n.op == "call_function"
        and (target is None or n.target == target)
        and isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].is_floating_point()
    ]


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize(
    "explicit_fp32, scale, kept",
    [("keep", 1.0, True), ("calibrated", 1.0, False), ("calibrated", 300.0, True)],
)
def test_rmsnorm_island_is_kept_by_policy_or_on_evidence(decompose, explicit_fp32, scale, kept):
    """to(f32) -> pow -> mean -> add -> rsqrt -> mul -> to(f32), not rewritten
    (``stabilize=False``): "keep" keeps the region in fp32 and the closing cast becomes
    the cast back to fp16. "calibrated" keeps it only when its values need fp32: inputs
    near 300 square to 9e4, beyond fp16."""
    torch.manual_seed(0)
    args = (torch.randn(3, 16) * scale,)
    ep, outputs = _cast_and_compare(  # eps in fp16's normal range: the island alone decides
        RMSNormMLP(eps=1e-4), args, decompose, explicit_fp32=explicit_fp32, stabilize=False
    )
    (rsqrt,) = _float_ops(ep, aten.rsqrt.default)
    assert rsqrt.meta["val"].dtype == (torch.float32 if kept else torch.float16)
    assert rsqrt.meta[PRECISION].reason == (Reason.EXPLICIT_FP32 if kept else Reason.FITS)
    rows = {row.rule: row for row in decision_rows(ep)}
    if explicit_fp32 == "calibrated":
        row = rows["explicit_fp32" if kept else "explicit_fp32_retargeted"]
        assert ("beyond" if kept else "fit 16-bit") in row.detail
    assert outputs[0].dtype == torch.float16


def test_rmsnorm_with_explicit_fp32_retargeted_is_all_fp16():
    torch.manual_seed(0)
    model = RMSNormMLP()
    args = (torch.randn(3, 16) * 300,)
    ep = export(model, *args)
    fx16.cast_fp32_to_fp16(ep, explicit_fp32="retarget", stabilize=False)
    check_program(ep)
    floats = _float_ops(ep)
    kept = [n for n in floats if n.meta["val"].dtype == torch.float32 and INSERTED not in n.meta]
    # only the squares beyond fp16 stay fp32, by the overflow rule, op by op, and the
    # rsqrt of their mean with its 1e-6 eps (below fp16's normal range) by the underflow rule
    assert kept and {n.meta[PRECISION].reason for n in kept} <= {
        Reason.ACTIVATION_OVERFLOW,
        Reason.FP32_INPUT,
        Reason.UNDERFLOW,
    }
    assert max_error(fp64_reference(model, *args), run(ep, *args)) < 1e-2


@pytest.mark.parametrize("decompose", [False, True])
def test_model_holding_fp16_int8_and_fp64_buffers(decompose):
    """Only fp32 tensors change: the int8 weight, fp16 bias and fp64 gain keep their dtypes."""
    torch.manual_seed(0)
    model = MixedBuffers()
    ep, outputs = _cast_and_compare(model, (torch.randn(2, 8),), decompose)
    assert ep.state_dict["qweight"].dtype == torch.int8
    assert ep.state_dict["half_bias"].dtype == torch.float16
    assert ep.state_dict["double_gain"].dtype == torch.float64
    assert ep.state_dict["scale"].dtype == torch.float16
    assert [o.dtype for o in outputs] == [torch.float16, torch.float64]


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize("accumulate", [False, True], ids=["written_over", "accumulated"])
def test_buffer_updated_in_place(decompose, accumulate):
    """A buffer written over each call is stored 16-bit; one accumulated into across
    calls stays fp32 (it grows with the calls), its update computed from 16-bit values."""
    torch.manual_seed(0)
    model = BufferUpdate(accumulate=accumulate)
    x = torch.randn(3, 4)
    ep = export(model, x, decompose=decompose)
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    expected = torch.float32 if accumulate else torch.float16
    assert ep.state_dict["running"].dtype == expected
    assert run(ep, x)[0].dtype == torch.float16


def test_buffer_that_overflows_keeps_its_dtype_when_written_back():
    """running holds 1e5: it stays fp32, and the value written back to it stays fp32."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    ep = export(BufferUpdate(start=1e5), x, decompose=True)
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    output = ep.graph_module.graph.output_node().args[0]
    assert ep.state_dict["running"].dtype == torch.float32
    assert output[0].meta["val"].dtype == torch.float32
    assert targets(ep)[aten._to_copy.default] >= 1
