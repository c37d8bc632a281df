"""Massive activations: fx16 keeps exactly the model's fp32 islands that need them.

Trained LLMs carry a few residual-stream channels in the thousands ("massive
activations"); an RMSNorm squares them beyond fp16. ``benchmarks.zoo`` builds a
Llama and a T5 encoder from configs whose first layer writes |x| ~ 2000 into two
channels: every norm after that layer needs its fp32 island, the norms before it
do not. Without the stable rewrites (``stabilize=False``) fx16 keeps exactly those
islands and stays within fp16 tolerance; by default it rewrites each norm so that its
squares stay in range, and nothing stays fp32; coreai-opt, which retargets every
island, computes garbage (its squares overflow to inf, and x / sqrt(inf) is 0).
"""

import copy

import pytest
import torch

import fx16
from benchmarks import coreai, zoo
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.explicit_fp32 import islands
from fx16.program.stats import relative_error
from fx16.report import report_of
from helpers import check_program, run

pytest.importorskip("transformers", reason="the test extra is not installed")

# model -> (builder, islands kept, islands retargeted): the first layer's two norms
# see ordinary values; every later norm (two a layer, and the final one) sees |x| ~ 2000.
MODELS = {
    "Llama": (zoo.massive_llama, 5, 2),
    "T5 encoder": (zoo.massive_t5_encoder, 3, 2),
}


def _exported(build, decompose):
    torch.manual_seed(0)
    model = build().eval().requires_grad_(False)  # as deployed (see test_coreai._for_inference)
    ids = zoo.massive_ids()
    ep = torch.export.export(model, (ids,))
    if decompose:  # the Core AI flow decomposes with coreai_torch's table first
        ep = coreai.decompose(ep) if _has_coreai() else ep.run_decompositions()
    with torch.no_grad():
        return model, ids, model(ids), ep


def _has_coreai() -> bool:
    try:
        import coreai_torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_unstabilized_cast_keeps_exactly_the_islands_that_need_fp32(name, decompose):
    build, kept, retargeted = MODELS[name]
    _, ids, expected, ep = _exported(build, decompose)
    fx16.cast_fp32_to_fp16(ep, explicit_fp32="calibrated", stabilize=False)
    check_program(ep)
    verdicts = islands(ep.graph_module)
    assert sum(island.keep for island in verdicts) == kept
    assert sum(not island.keep for island in verdicts) == retargeted
    squares = {
        node.name: node.meta.get(CalibrationAnalysis.META_KEY, 0.0)
        for node in ep.graph_module.graph.nodes
    }
    for island in verdicts:  # kept: squares of |x| >= 1000; retargeted: ordinary values
        largest = max(squares.get(member, 0.0) for member in island.members)
        assert (largest >= 1e6) if island.keep else (largest < 1e3), island
    (got,) = run(ep, ids)
    assert torch.isfinite(got).all()
    assert relative_error(expected.double(), got.double()) < 1e-2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_calibrated_cast_rewrites_every_norm_and_keeps_no_float_op_fp32(name):
    """The stable rewrite scales each norm's squares into range: every island's ops in
    16-bit, and the result as close to fp32 as the islands kept in fp32 were."""
    build, _, _ = MODELS[name]
    _, ids, expected, ep = _exported(build, decompose=False)
    fx16.cast_fp32_to_fp16(ep, explicit_fp32="calibrated")
    check_program(ep)
    rows = report_of(ep).rows
    assert sum(r.stabilized.startswith("rms_norm_scaling") for r in rows) == sum(MODELS[name][1:])
    verdicts = islands(ep.graph_module)
    assert len(verdicts) == sum(MODELS[name][1:]) and not any(i.keep for i in verdicts)
    (got,) = run(ep, ids)
    assert torch.isfinite(got).all()
    assert relative_error(expected.double(), got.double()) < 1e-2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_retargeting_every_island_is_what_goes_wrong(name):
    """coreai-opt's cast of the same program: finite-looking zeros, or inf."""
    cast_to_16_bit_precision = pytest.importorskip("coreai_opt.casting").cast_to_16_bit_precision
    build, _, _ = MODELS[name]
    _, ids, expected, ep = _exported(build, decompose=True)
    peer = copy.deepcopy(ep)
    cast_to_16_bit_precision(peer)
    (got,) = run(peer, ids)
    assert not torch.isfinite(got).all() or relative_error(expected.double(), got.double()) > 0.5
    fx16.cast_fp32_to_fp16(ep)
    (ours,) = run(ep, ids)
    assert relative_error(expected.double(), ours.double()) < 1e-2
