"""NoLowKernelRule: an ATen op with no 16-bit kernel (an FFT, a factorization, a special
function) computes in fp32, so the cast program runs wherever the fp32 one does."""

import re

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fx16
from fx16.analysis.fp32_rules import fp32_rule
from fx16.decisions import PRECISION, Reason
from fx16.ops.tables import NO_LOW_KERNEL_OPS
from helpers import check_program, export, fp64_reference, max_error, node_named, run

aten = torch.ops.aten


class SpectralMix(nn.Module):
    """FNet's token mixing, reduced: ``fftn(linear(x), dim=(1, 2)).real``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.fft.fftn(self.lin(x), dim=(1, 2)).real


@pytest.mark.parametrize("decompose", [False, True])
def test_an_fft_reads_fp32_and_the_product_before_it_stays_16_bit(decompose):
    """Input graph: linear -> fft_fftn -> real (decomposed: addmm -> _to_copy(complex)
    -> _fft_c2c -> view_as_real -> select). Output graph: the product in fp16, the FFT
    on its result cast up, reason ``no_low_kernel``. Before: the cast program raised
    "Unsupported dtype Half" on the CPU."""
    torch.manual_seed(0)
    model, x = SpectralMix().eval(), torch.randn(2, 4, 8)
    ep = export(model, x)
    if decompose:
        ep = ep.run_decompositions()
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    ffts = [n for n in nodes if n.target in NO_LOW_KERNEL_OPS]
    assert ffts and all(fp32_rule(n).reason is Reason.NO_LOW_KERNEL for n in ffts)
    product = next(n for n in nodes if n.target in (aten.linear.default, aten.addmm.default))
    assert product.meta["val"].dtype == torch.float16
    assert fx16.report.report_of(ep).totals.flop_share_16bit == 1.0
    assert max_error(fp64_reference(model, x), run(ep, x)) < 4e-3


def test_fnet_runs_after_the_cast():
    """transformers' FNetModel (in PyTorch's benchmark list) mixes tokens with fftn."""
    from transformers import FNetConfig, FNetModel

    config = FNetConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        max_position_embeddings=64,
        use_tpu_fourier_optimizations=False,
    )
    torch.manual_seed(0)
    model, ids = FNetModel(config).eval(), torch.randint(0, 100, (1, 16))
    ep = fx16.cast_fp32_to_fp16(export(model, ids))
    assert len([n for n in ep.graph.nodes if n.target == aten.fft_fftn.default]) == 2
    assert node_named(ep, "fft_fftn").meta[PRECISION].reason is Reason.NO_LOW_KERNEL
    assert max_error(fp64_reference(model, ids), run(ep, ids)) < 1e-2


class _Recorder(TorchDispatchMode):
    """Every ATen call made under it, with its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


def _as_half(value):
    return (
        value.half() if isinstance(value, torch.Tensor) and value.dtype == torch.float32 else value
    )


def _fails_in_half(func, args, kwargs) -> bool:
    """``func`` refuses fp16 where it took fp32: "not implemented for 'Half'" and kin."""
    half_args, half_kwargs = pytree.tree_map(_as_half, (args, kwargs))
    try:
        func(*half_args, **half_kwargs)
    except Exception as error:
        return bool(re.search(r"Half|float16", str(error).splitlines()[0] if str(error) else ""))
    return False


def test_the_table_holds_every_op_of_the_op_database_without_a_half_cpu_kernel():
    """For each OpInfo whose CPU dtypes have float32 but not float16, every ATen op its
    first fp32 sample calls is tried on the same arguments in fp16; each that refuses
    them is in ``NO_LOW_KERNEL_OPS``."""
    from torch.testing._internal.common_methods_invocations import op_db

    missing, checked = set(), 0
    for info in op_db:
        dtypes = info.supported_dtypes("cpu")
        if torch.float32 not in dtypes or torch.float16 in dtypes:
            continue
        try:
            sample = next(iter(info.sample_inputs("cpu", torch.float32)))
        except StopIteration:
            continue
        recorder = _Recorder()
        try:
            with recorder:
                info(sample.input, *sample.args, **sample.kwargs)
        except Exception:
            pass  # the calls made before the failure are recorded
        for func, args, kwargs in recorder.calls:
            checked += 1
            if func not in NO_LOW_KERNEL_OPS and _fails_in_half(func, args, kwargs):
                missing.add(str(func))
    assert checked > 100
    assert not missing, sorted(missing)
