"""Ops outside aten/prims: the dtype fx16 records is the dtype the op's fake kernel
computes, a custom op's dtype argument follows the cast, and an op whose fake kernel
refuses 16-bit inputs keeps them as exported, with a reason."""

import pytest
import torch

import fx16
from fx16.decisions import Reason, decision_of
from fx16.program.nodes import requested_dtypes
from fx16.program.propagation import narrowed_result, runs_narrowed
from fx16.report import report_of
from fx16.testing.custom_ops import DefaultDtypeDequantize, QuantizedLinear, UserOps
from helpers import check_program, export, node_named, run

DIALECTS = pytest.mark.parametrize("decompose", [False, True], ids=["training IR", "ATen"])


def _custom_nodes(ep, name):
    found = [n for n in ep.graph.nodes if str(n.target).startswith(name)]
    assert found, f"no {name} node"
    return found


@DIALECTS
def test_dequantize_records_what_it_computes_and_its_output_dtype_follows(decompose):
    """Input graph: dequantize(int8 w, fp32 scale, float32) -> linear(dequantize(quantize(x))).
    Output graph: the scales fp16, every dequantize computes and records fp16, its
    output_dtype argument says float16, and the linear runs in fp16. (Seeded: an fp16
    input to the activation quantizer may pick the neighbouring int8 code for a value
    at a code boundary, one step of 0.065.)"""
    torch.manual_seed(0)
    ep = export(QuantizedLinear(), torch.randn(3, 8), decompose=decompose)
    x = torch.randn(3, 8)
    reference = ep.module()(x)
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)  # includes: every node's meta dtype is the dtype it computes
    for node in _custom_nodes(ep, "fx16_test.dequantize"):
        assert node.meta["val"].dtype == torch.float16
        assert node.args[2] == torch.float16
        assert decision_of(node).reason == Reason.FITS
    assert not [row for row in report_of(ep).kept_wide() if row.kind == "float"]
    assert ep.state_dict["qweight"].dtype == torch.int8
    (output,) = run(ep, x)
    assert output.dtype == torch.float16
    torch.testing.assert_close(output.float(), reference, rtol=0, atol=2e-2)


def test_a_custom_dtype_argument_is_not_an_explicit_fp32_request():
    ep = export(UserOps(), torch.randn(3, 8))
    scaled = node_named(ep, "scaled_to")
    assert scaled.args[2] == torch.float32
    assert requested_dtypes(scaled) == []
    summed = export(SumInFp32(), torch.randn(3, 8))
    assert requested_dtypes(node_named(summed, "sum_1")) == [torch.float32]


class SumInFp32(torch.nn.Module):
    def forward(self, x):
        return x.sum(-1, dtype=torch.float32)


@DIALECTS
def test_user_ops_fixed_dtype_and_refusing_kernels(decompose):
    """Input graph: linear -> scaled_to(.., float32) -> tanh -> always_fp32 -> sigmoid ->
    fp32_only -> linear. Output graph: scaled_to computes fp16; always_fp32 records fp32
    (its kernel returns fp32) and sigmoid reads it cast down; fp32_only, whose fake
    kernel refuses fp16, reads fp32 as exported, and its result is cast back."""
    ep = export(UserOps(), torch.randn(3, 8), decompose=decompose)
    x = torch.randn(3, 8)
    reference = ep.module()(x)
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    (scaled,) = _custom_nodes(ep, "fx16_test.scaled_to")
    (fixed,) = _custom_nodes(ep, "fx16_test.always_fp32")
    (refusing,) = _custom_nodes(ep, "fx16_test.fp32_only")
    assert scaled.meta["val"].dtype == torch.float16 and scaled.args[2] == torch.float16
    assert fixed.meta["val"].dtype == torch.float32
    assert decision_of(fixed).reason == Reason.FIXED_OUTPUT_DTYPE
    assert decision_of(refusing).reason == Reason.NO_FAKE_KERNEL
    assert refusing.args[0].meta["val"].dtype == torch.float32
    rules = {row.node: row.rule for row in report_of(ep).rows}
    assert rules[refusing.name] == "no_fake_kernel"
    (output,) = run(ep, x)
    torch.testing.assert_close(output.float(), reference, rtol=0, atol=1e-2)


def test_an_op_without_any_fake_kernel_keeps_its_inputs():
    """The op's meta kernel is registered for export and removed before the cast (as when
    a program is loaded where the library that defined its fake kernel is not)."""
    library = torch.library.Library("fx16_test_nofake", "DEF")
    library.define("double(Tensor x) -> Tensor")
    library.impl("double", lambda x: x * 2, "CPU")
    meta = torch.library.Library("fx16_test_nofake", "IMPL")
    meta.impl("double", lambda x: torch.empty_like(x), "Meta")

    class Doubling(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(torch.ops.fx16_test_nofake.double(self.linear(x)))

    try:
        ep = export(Doubling(), torch.randn(2, 4))
        meta._destroy()
        node = node_named(ep, "double")
        assert not runs_narrowed(node, torch.float16)
        fx16.cast_fp32_to_fp16(ep)
        assert decision_of(node).reason == Reason.NO_FAKE_KERNEL
        assert node.args[0].meta["val"].dtype == torch.float32
        x = torch.randn(2, 4)
        assert run(ep, x)[0].dtype == torch.float16
    finally:
        library._destroy()


def test_narrowed_result_asks_the_fake_kernel():
    """dequantize's fake kernel returns its scale's dtype, not its input's: with the scale
    still fp32 the result is fp32 (ATen's follow-the-inputs rule would say fp16); once the
    scale is fp16 it is fp16, although output_dtype still says float32."""
    ep = export(QuantizedLinear(), torch.randn(3, 8))
    node = _custom_nodes(ep, "fx16_test.dequantize")[0]
    assert node.args[2] == torch.float32
    assert narrowed_result(node, torch.float16, produces_fp32=True).dtype == torch.float32
    scale = node.args[1]
    scale.meta["val"] = scale.meta["val"].to(torch.float16)
    assert narrowed_result(node, torch.float16, produces_fp32=True).dtype == torch.float16


@DIALECTS
def test_a_defaulted_output_dtype_follows_the_cast_too(decompose):
    """Input graph: dequantize_to(int8 w, scale) (output_dtype defaults to float32) -> mm.
    Output graph: dequantize_to(.., output_dtype=float16) -> mm, all fp16."""
    ep = export(DefaultDtypeDequantize(), torch.randn(3, 8), decompose=decompose)
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    (node,) = _custom_nodes(ep, "fx16_test.dequantize_to")
    assert node.kwargs["output_dtype"] == torch.float16
    assert node.meta["val"].dtype == torch.float16
    assert not report_of(ep).kept_wide()
