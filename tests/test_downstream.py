"""Cast programs through the standard downstream tools: save/load, decompositions,
inductor, AOTInductor and ONNX (run in onnxruntime). Each must reproduce the cast
program's own output."""

import copy
import io

import onnxruntime
import pytest
import torch

import fx16
from benchmarks.zoo import bert, gpt2

BUILDERS = {"gpt2": lambda: gpt2(2, width=64, vocab=512), "bert": lambda: bert(2)}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def cast(request):
    """(cast program, input ids, the cast program's own output) for each model."""
    torch.manual_seed(0)
    model = BUILDERS[request.param]()
    ids = torch.randint(0, 512, (1, 16))
    ep = fx16.cast_to_16_bit_precision(torch.export.export(model, (ids,)))
    with torch.no_grad():
        expected = ep.module()(ids)
    return ep, ids, expected


def _close(got, expected, tolerance=1e-2):
    assert got.dtype == expected.dtype
    scale = expected.float().abs().max()
    assert (got.float() - expected.float()).abs().max() <= tolerance * scale


def test_save_and_load_round_trip(cast):
    ep, ids, expected = cast
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    with torch.no_grad():
        assert torch.equal(loaded.module()(ids), expected)


def test_run_decompositions(cast):
    ep, ids, expected = cast
    decomposed = copy.deepcopy(ep).run_decompositions()
    with torch.no_grad():
        _close(decomposed.module()(ids), expected)


def test_torch_compile_with_inductor(cast):
    ep, ids, expected = cast
    compiled = torch.compile(ep.module(), backend="inductor")
    with torch.no_grad():
        _close(compiled(ids), expected)


def test_onnx_export_runs_in_onnxruntime(cast):
    ep, ids, expected = cast
    onnx_program = torch.onnx.export(ep, (ids,), dynamo=True, verbose=False)
    buffer = io.BytesIO()
    onnx_program.save(buffer)
    session = onnxruntime.InferenceSession(buffer.getvalue())
    (got,) = session.run(None, {session.get_inputs()[0].name: ids.numpy()})
    _close(torch.from_numpy(got), expected)


@pytest.mark.slow
def test_aoti_compile_and_package(tmp_path):
    """One slower test: AOTInductor compiles the cast GPT-2 to a package and runs it."""
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (1, 16))
    ep = fx16.cast_to_16_bit_precision(torch.export.export(BUILDERS["gpt2"](), (ids,)))
    with torch.no_grad():
        expected = ep.module()(ids)
    package = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    runner = torch._inductor.aoti_load_package(package)
    with torch.no_grad():
        _close(runner(ids), expected)
