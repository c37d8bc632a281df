"""fx16.declare_op: how a custom op treats dtypes (the argument that sets its output
dtype) and scales (the arguments its result is linear in), for PT2E's dequantize ops,
torchao's and a user's own."""

import math

import pytest
import torch
from torch import nn

import fx16
from benchmarks import range_flows
from fx16.analysis.scale_domains import scale_domains
from fx16.errors import InvalidOptionError
from fx16.ops.declarations import declaration
from fx16.passes.scale_domains import REVERTED
from fx16.program.stats import program_stats
from fx16.report import report_of
from fx16.testing.custom_ops import DefaultDtypeDequantize
from helpers import check_program, export, run, scale_only


def test_a_pt2e_int8_program_runs_its_products_in_16_bit():
    """Input graph: quantize -> dequantize_per_tensor (out_dtype None: fp32) -> linear
    (int8 weights through dequantize_per_channel) -> ... Output: each dequantize given
    out_dtype=float16, every matmul FLOP 16-bit, the biases stored fp16, the outputs
    within 16-bit rounding of the int8 program's (the int8 values are unchanged)."""
    pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    torch.manual_seed(0)
    (x,) = range_flows.mlp_inputs()
    ep = torch.export.export(range_flows.pt2e_int8_mlp(), (x,))
    with torch.no_grad():
        expected = ep.module()(x)
    fx16.cast_to_16_bit_precision(ep)
    check_program(ep)
    dequantizes = [
        n
        for n in ep.graph_module.graph.nodes
        if n.op == "call_function" and "dequantize" in str(n.target)
    ]
    assert dequantizes and all(n.kwargs.get("out_dtype") == torch.float16 for n in dequantizes)
    stats = program_stats(ep)
    assert stats.flop_share_16bit == 1.0
    assert stats.fp32_weight_bytes == 0
    got = run(ep, x)[0].double()
    assert float((got - expected.double()).abs().max() / expected.abs().max()) < 2e-2


class BlockScaled(nn.Module):
    """int8 weights with per-row scales of ~3e-6 (subnormal in fp16), dequantized by a
    user's op declared linear in its scale, then a product and an output scale."""

    def __init__(self) -> None:
        super().__init__()
        weight = torch.randn(64, 32) * 1e-4
        scale = weight.abs().amax(1, keepdim=True) / 127
        self.register_buffer("qweight", torch.round(weight / scale).to(torch.int8))
        self.register_buffer("scale", scale)

    def forward(self, x):
        weight = torch.ops.fx16_test.dequantize_to(self.qweight, self.scale)
        return x @ weight.t() * 1e3


@pytest.fixture
def declared_dequantize():
    op = torch.ops.fx16_test.dequantize_to
    yield fx16.declare_op(op, output_dtype="output_dtype", linear_in=("scale",))
    fx16.ops.declarations._DECLARED.pop("fx16_test::dequantize_to", None)


def test_subnormal_block_scales_are_carried_at_a_power_of_two(declared_dequantize):
    """Input graph: dequantize_to(int8, scale ~3e-6) -> t -> matmul -> mul 1e3. Output:
    the scale stored fp16 at 2**k (its largest at least 2**-8), the dequantize and the
    product 16-bit and carried at 2**k, taken back in the 1e3: no fp32 op, no cast."""
    torch.manual_seed(0)
    model, x = BlockScaled().eval(), torch.randn(8, 32)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    (domain,) = scale_domains(ep.graph_module)
    # lifted by the least power of two that brings the scales' largest to 2**-8
    lift = math.ceil(math.log2(2.0**-8 / float(model.scale.abs().max())))
    assert domain.folded == ("b_scale",) and domain.k == -lift
    stored = ep.state_dict["scale"]
    assert stored.dtype == torch.float16 and 2.0**-8 <= float(stored.abs().max()) < 2.0**-7
    stats = program_stats(ep)
    assert stats.ops_in(torch.float32) == 0 and stats.casts == 0
    with torch.no_grad():  # its custom op computes in the scale's dtype: fp32, not fp64
        expected = model(x).double()
    got = run(ep, x)[0].double()
    assert float((got - expected).abs().max() / expected.abs().max()) < 4 * 2.0**-11


class OffsetBlocks(BlockScaled):
    """``BlockScaled`` with its scales' largest set to ``scale_max`` (when given) and a
    buffer of ``offset`` added to the dequantized weight (in the scales' domain)."""

    def __init__(self, scale_max: float | None = None, offset: float | None = None) -> None:
        super().__init__()
        if scale_max is not None:
            self.scale.mul_(scale_max / self.scale.max())
        self.offset = offset
        self.register_buffer("shift", torch.full((64, 1), offset or 0.0))

    def forward(self, x):
        weight = torch.ops.fx16_test.dequantize_to(self.qweight, self.scale)
        if self.offset is not None:
            weight = weight + self.shift
        return x @ weight.t() * 1e3


@pytest.mark.parametrize(
    ("options", "lift"),
    [
        ({"scale_max": 2.0**-14}, None),  # the smallest normal: not below the range
        ({"scale_max": 2.0**-14 - 2.0**-25}, 7),  # just below: to 2**-8 by 2**7
        ({"offset": 0.0}, 11),  # a zero member needs no lift and bounds none
        ({"offset": 12.0}, 11),  # 12 * 2**11 < 32752: room for exactly the lift
        ({"offset": 1e3}, None),  # 1e3 * 2**11 would pass 32752: no room
    ],
)
def test_block_scales_are_lifted_where_below_the_normal_range_and_every_member_fits(
    declared_dequantize, options, lift
):
    """The scales (~3e-6, their largest brought to at least 2**-8 by 2**11) are lifted
    only where their largest lies below fp16's smallest normal (2**-14: not at it), and
    only where every other value of their domain still fits 32752 (fp16's maximum over
    the margin) at the lift: a weight offset by 12 fits at 2**11 exactly, one offset by
    1e3 does not. A zero member is neither small nor large. The plan applies exactly."""
    torch.manual_seed(0)
    model, x = OffsetBlocks(**options).eval(), torch.randn(8, 32)
    ep = export(model, x)
    scale_only(ep)
    assert REVERTED not in ep.graph_module.meta, ep.graph_module.meta.get(REVERTED)
    lifted = [d.k for d in scale_domains(ep.graph_module) if "b_scale" in d.folded]
    assert lifted == ([] if lift is None else [-lift])
    with torch.no_grad():
        assert torch.equal(model(x), ep.module()(x))


def test_without_the_declaration_the_scales_stay_fp32():
    """The same program with nothing declared: the subnormal scale stays fp32 and the
    dequantize computes in fp32 (what a declaration saves)."""
    torch.manual_seed(0)
    model, x = BlockScaled().eval(), torch.randn(8, 32)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    rows = {row.node: row for row in report_of(ep).rows}
    assert rows["b_scale"].dtype == "float32" and rows["dequantize_to"].dtype == "float32"


def test_a_declared_output_dtype_is_passed_where_the_op_computes_16_bit(declared_dequantize):
    """dequantize_to's output_dtype defaults to float32; declared, the cast passes
    float16 there, and the product reading it is 16-bit."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    ep = fx16.cast_fp32_to_fp16(export(DefaultDtypeDequantize().eval(), x))
    check_program(ep)
    (node,) = [n for n in ep.graph_module.graph.nodes if "dequantize_to" in str(n.target)]
    assert node.kwargs.get("output_dtype") == torch.float16
    assert program_stats(ep).flop_share_16bit == 1.0


@pytest.mark.parametrize(
    ("op", "options", "match"),
    [
        (torch.ops.fx16_test.dequantize_to, {"linear_in": ("scales",)}, "has no argument scales"),
        ("dequantize_to", {}, "namespace::op"),
        (42, {}, "takes an op or its name"),
    ],
)
def test_a_malformed_declaration_is_refused(op, options, match):
    with pytest.raises(InvalidOptionError, match=match):
        fx16.declare_op(op, **options)
    assert declaration(torch.ops.fx16_test.dequantize_to.default) is None
