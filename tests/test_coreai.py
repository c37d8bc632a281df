"""The seeds' own downstream: cast programs convert with the Core AI converter.

Flow (the coreai-opt casting docs'): export, decompose with coreai_torch's table, cast,
``TorchConverter().add_exported_program(ep).to_coreai()``, ``save_asset``. Needs the
``coreai`` extra (CI installs it)."""

import copy
import functools

import pytest
import torch
import torch.utils._pytree as pytree

import fx16
from benchmarks import coreai, range_flows, zoo
from fx16.program.stats import relative_error
from fx16.report.rows import decision_rows
from helpers import check_program, run
from models import AutocastRegions

pytest.importorskip("coreai_torch", reason="the coreai extra is not installed")

MODELS = {name: (build, args, ranges) for name, build, args, ranges in coreai.models()}

# Rules under which fx16 keeps fp32 on purpose; an op following such an op reads fp32.
DELIBERATE = {
    "explicit_fp32",
    "activation_overflow",
    "underflow",
    "unsafe_index",
    "fp32_input",
    "ill_conditioned",
}


# The tools these tests read (the benchmark's table also converts fx16 with stabilize=False).
TOOLS = {"uncast", "fx16", "fx16 16-bit", coreai.PEER, coreai.WITHOUT_PRECISION_RULES}


@functools.cache
def _measured(name):
    return coreai.measure(*MODELS[name], only=TOOLS)


def _for_inference(ep):
    """Parameters that do not require grad, as in deployment. (PyTorch's CPU
    scaled_dot_product_attention picks its math kernel for fp16 when the mask requires
    grad, and that kernel's output layout is not the one export recorded: the
    coreai-decomposed T5 then fails a later ``view``, cast by fx16 or by coreai-opt.)"""
    for tensor in ep.state_dict.values():
        tensor.requires_grad_(False)
    return ep


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_converts_before_and_after_the_cast(name):
    results = _measured(name)
    uncast, _ = results["uncast"]
    assert not isinstance(uncast, str), uncast
    for tool in ("fx16", "fx16 16-bit"):
        types, ep = results[tool]
        assert not isinstance(types, str), f"{tool}: {types}"
        check_program(_for_inference(ep))
        if uncast["f32"]:
            assert types["f16"] > 0, f"{tool} left no f16 in the converted program"
        assert types["f32"] <= uncast["f32"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp32_beyond_coreai_opt_is_deliberate_and_named(name):
    """fx16's f32 share is at most coreai-opt's, except for the fp32 it keeps on
    purpose; every such op has its rule in the decision report."""
    results = _measured(name)
    if "coreai-opt 0.3.0" not in results:
        pytest.skip("coreai-opt is not installed (bench extra)")
    peer, _ = results["coreai-opt 0.3.0"]
    types, ep = results["fx16"]
    if isinstance(peer, str) or coreai.f32_share(types) <= coreai.f32_share(peer):
        return
    fp32_rows = [r for r in decision_rows(ep) if r.kind == "float" and r.dtype == "float32"]
    assert fp32_rows
    assert {row.rule for row in fp32_rows} <= DELIBERATE
    assert {row.rule for row in fp32_rows} - {"fp32_input"}, "no op started the fp32 region"


@pytest.mark.parametrize("name", ["int counters", "int running count"])
def test_int16_narrowed_programs_convert_and_stay_exact(name):
    build, args, ranges = MODELS[name]
    types, ep = _measured(name)["fx16 16-bit"]
    assert types["si16"] > 0
    torch.manual_seed(0)
    expected = pytree.tree_leaves(build().eval()(*args))
    for got, want in zip(run(ep, *args), expected):
        if not want.is_floating_point():
            assert torch.equal(got.to(want.dtype), want)


def test_calibration_overflow_survives_conversion():
    """The exp trap's fp32 logits reach Core AI as f32, and the result the cast program
    computes is finite and accurate. (The squared-sum trap's energy no longer needs
    fp32: the stable rewrite scales its squares into range.)"""
    build, args, _ = MODELS["trap: exp of large logits"]
    types, ep = _measured("trap: exp of large logits")["fx16"]
    assert types["f32"] > 0
    rules = {r.rule for r in decision_rows(ep) if r.dtype == "float32"}
    assert "activation_overflow" in rules
    torch.manual_seed(0)
    expected = build().eval()(*args)
    (got,) = run(ep, *args)
    assert torch.isfinite(got).all()
    assert (got.float() - expected).abs().max() < 1e-2


def test_autocast_region_cast_before_decomposing_reaches_core_ai_in_fp32():
    """Decomposition inlines autocast regions and drops their flags, so a model with
    ``torch.autocast(enabled=False)`` is cast first: the region's casts then survive
    the converter's decomposition."""
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    ep = fx16.cast_fp32_to_fp16(torch.export.export(AutocastRegions().eval(), (x,)))
    decomposed = coreai.decompose(copy.deepcopy(ep))
    types = coreai.convert(decomposed)
    assert types["f32"] > 0 and types["f16"] > 0
    with torch.no_grad():
        assert torch.allclose(decomposed.module()(x.half()), ep.module()(x.half()))


GOAL_MODELS = ["BERT", "GPT-2", "Llama", "T5 encoder", "ViT", "ResNet-style CNN"]


@pytest.mark.parametrize("name", GOAL_MODELS)
def test_as_16_bit_as_coreai_opt_where_its_output_is_correct(name):
    """Precision rules aside, fx16 keeps at most coreai-opt's f32 share + 0.02."""
    results = _measured(name)
    if coreai.PEER not in results:
        pytest.skip("coreai-opt is not installed (bench extra)")
    build, args, _ = MODELS[name]
    assert coreai.is_correct(coreai.output_error(build, args, results[coreai.PEER][1]))
    assert coreai.is_correct(coreai.output_error(build, args, results["fx16"][1]))
    without, _ = results[coreai.WITHOUT_PRECISION_RULES]
    peer, _ = results[coreai.PEER]
    assert coreai.f32_share(without) <= coreai.f32_share(peer) + coreai.GOAL


def test_kv_cache_decoder_keeps_its_cache_in_fp16_and_decodes_like_fp32():
    """transformers' on-device export (a static cache the program updates in place):
    after the cast the key/value buffers are fp16, still written by the program, and
    four decoding steps match the fp32 model."""
    types, ep = _measured("Llama decoder, static KV cache")["fx16"]
    assert not isinstance(types, str), types
    caches = {
        name: tensor
        for name, tensor in ep.constants.items()
        if "cache" in name and tensor.is_floating_point()
    }
    assert len(caches) == 4 and all(t.dtype == torch.float16 for t in caches.values())
    assert set(caches) <= set(ep.graph_signature.buffers_to_mutate.values())
    torch.manual_seed(0)
    model = zoo.llama_decoder().eval()
    module = copy.deepcopy(ep).module()
    with torch.no_grad():
        for step, token in enumerate([3, 7, 11, 5]):
            args = (torch.tensor([[token]]), torch.tensor([step]))
            assert relative_error(model(*args).double(), module(*args).double()) < 1e-2


def test_core_ai_block_scales_below_fp16s_range_are_carried_not_kept_fp32():
    """coreai-opt's int8 block quantization (Quantizer, finalize for Core AI, export,
    decompose), then the combined cast. Input graph: constexpr_blockwise_shift_scale(
    int8, scale ~3e-6) -> linear. Output: the scales stored fp16 in its normal range (at a
    power of two), the dequantize and the product 16-bit, no fp32 op and no per-call cast
    of the weight; the result within one step of the output's int8 quantization (a
    rounding near a step's middle may take the other step), plus fp16's rounding, of the
    fp32 program's."""
    pytest.importorskip("coreai_opt.quantization")
    torch.manual_seed(0)
    (x,) = range_flows.block_quantized_inputs()
    ep = torch.export.export(range_flows.coreai_block_quantized(), (x,)).run_decompositions()
    scales = [n for n, t in ep.state_dict.items() if n.endswith("weight.0.scale")]
    assert scales and all(ep.state_dict[n].abs().max() < 2.0**-14 for n in scales)
    output_step = float(ep.state_dict["linear.linear_quantize_output_0.dequantize.scale"])
    with torch.no_grad():
        expected = ep.module()(x).double()
    fx16.cast_to_16_bit_precision(ep)
    check_program(ep)
    for name in scales:
        stored = ep.state_dict[name]
        assert stored.dtype == torch.float16 and stored.abs().min() >= 2.0**-14, name
    float_ops = [
        node
        for node in ep.graph.nodes
        if node.op == "call_function"
        and getattr(node.meta.get("val"), "dtype", None) is not None
        and node.meta["val"].is_floating_point()
    ]
    assert all(node.meta["val"].dtype == torch.float16 for node in float_ops)
    weight_sized = 64 * 512
    assert not [
        node
        for node in ep.graph.nodes
        if node.target == torch.ops.aten._to_copy.default
        and node.meta["val"].numel() >= weight_sized
    ]
    (got,) = run(ep, x.half())
    rounding = 4 * 2.0**-11 * float(expected.abs().max())  # fp16's, on the step and result
    assert float((got.double() - expected).abs().max()) <= output_step + rounding
