"""Compressed programs: the models and compressions of the seeds' second flow.

coreai-opt's "Casting a compressed model" flow compresses first (quantization,
palettization, pruning), finalizes for the Core AI backend, exports, optionally
decomposes with ``coreai_torch.get_decomp_table()``, and casts last. torchao, PyTorch's
own quantization library, is the other common source of compressed programs; its
weights stay tensor subclasses in the exported state.

``compressed_program(compression, model)`` builds one such program from a seeded model;
``benchmarks.compressed`` tabulates them and the tests use the same recipes.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


class ConvNet(nn.Module):
    """Two 3x3 convolutions with ReLU, global average pooling, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.head(x.mean((2, 3)))


class GatedMLP(nn.Module):
    """A SwiGLU feed-forward block: down(silu(gate(x)) * up(x))."""

    def __init__(self, width: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.gate = nn.Linear(width, hidden)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention and a gated MLP, each with a residual."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = GatedMLP(width, 2 * width)

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)

        def split(t):
            return t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2)

        attended = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.mlp(self.norm2(x))


# name -> (model class, example input shape)
MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "conv net": (ConvNet, (2, 3, 16, 16)),
    "gated MLP": (GatedMLP, (4, 64)),
    "transformer block": (TransformerBlock, (2, 8, 64)),
}


def model_and_input(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    cls, shape = MODELS[name]
    torch.manual_seed(seed)
    return cls().eval(), torch.randn(shape)


# ---- coreai-opt ----------------------------------------------------------------------


def _finalized(compressor, example: torch.Tensor, calibrate: bool) -> nn.Module:
    from coreai_opt import ExportBackend

    prepared = compressor.prepare((example,))
    if calibrate:
        with compressor.calibration_mode():
            for _ in range(2):
                prepared(example)
    return compressor.finalize(backend=ExportBackend.CoreAI)


def _quantized(config_factory: Callable) -> Callable:
    def compress(model: nn.Module, example: torch.Tensor) -> nn.Module:
        from coreai_opt.quantization import Quantizer

        return _finalized(Quantizer(model, config_factory()), example, calibrate=True)

    return compress


def _weight_only(dtype: torch.dtype):
    from coreai_opt.quantization import QuantizerConfig
    from coreai_opt.quantization.config.quantization_config import (
        ModuleQuantizerConfig,
        default_weight_quantization_spec,
    )
    from coreai_opt.quantization.spec.spec import QuantizationSpec

    spec = QuantizationSpec(
        dtype=dtype,
        granularity=default_weight_quantization_spec().granularity,
        qparam_calculator_cls="static",
    )
    return QuantizerConfig(
        global_config=ModuleQuantizerConfig(
            op_input_spec=None, op_output_spec=None, op_state_spec={"weight": spec}
        )
    )


def _default_quantization():
    from coreai_opt.quantization import QuantizerConfig

    return QuantizerConfig()


def _partial_quantization():
    from coreai_opt.quantization import QuantizerConfig

    return QuantizerConfig(module_type_configs={nn.Linear: None})


def _eager_partial_quantization():
    from coreai_opt.quantization import QuantizerConfig

    return QuantizerConfig(execution_mode="eager", module_type_configs={nn.Linear: None})


def _palettized(bits: int) -> Callable:
    def compress(model: nn.Module, example: torch.Tensor) -> nn.Module:
        from coreai_opt.palettization import (
            KMeansPalettizer,
            KMeansPalettizerConfig,
            ModuleKMeansPalettizerConfig,
            PalettizationSpec,
        )

        spec = PalettizationSpec(n_bits=bits)
        config = KMeansPalettizerConfig(
            global_config=ModuleKMeansPalettizerConfig(op_state_spec={"weight": spec})
        )
        return _finalized(KMeansPalettizer(model, config), example, calibrate=False)

    return compress


def _pruned(model: nn.Module, example: torch.Tensor) -> nn.Module:
    from coreai_opt.pruning import MagnitudePruner, MagnitudePrunerConfig

    return _finalized(MagnitudePruner(model, MagnitudePrunerConfig()), example, calibrate=False)


# ---- torchao -------------------------------------------------------------------------


def _torchao(config_name: str, **options) -> Callable:
    def compress(model: nn.Module, example: torch.Tensor) -> nn.Module:
        import torchao.quantization as quantization

        quantization.quantize_(model, getattr(quantization, config_name)(**options))
        return model

    return compress


# name -> compress(model, example input) -> the module to export
COMPRESSIONS: dict[str, Callable[[nn.Module, torch.Tensor], nn.Module]] = {
    "coreai-opt int8 weights+activations": _quantized(_default_quantization),
    "coreai-opt int8 weight-only": _quantized(lambda: _weight_only(torch.int8)),
    "coreai-opt int4 weight-only": _quantized(lambda: _weight_only(torch.int4)),
    "coreai-opt partial (Linear unquantized)": _quantized(_partial_quantization),
    "coreai-opt eager, partial": _quantized(_eager_partial_quantization),
    "coreai-opt 4-bit palettization": _palettized(4),
    "coreai-opt 8-bit palettization": _palettized(8),
    "coreai-opt 50% pruning": _pruned,
    "torchao int8 weight-only": _torchao("Int8WeightOnlyConfig"),
    "torchao int8 dynamic activations": _torchao("Int8DynamicActivationInt8WeightConfig"),
    # Int4WeightOnlyConfig needs a GPU kernel package to export; the Intx layout runs on CPU.
    "torchao int4 weight-only": _torchao("IntxWeightOnlyConfig", weight_dtype=torch.int4),
}


def compressed_program(
    compression: str, model: str, decomposed: bool = False
) -> tuple[torch.export.ExportedProgram, torch.Tensor]:
    """The exported program of ``model`` compressed by ``compression`` and its example
    input; ``decomposed``: after ``run_decompositions(coreai_torch.get_decomp_table())``."""
    module, example = model_and_input(model)
    compressed = COMPRESSIONS[compression](module, example)
    ep = torch.export.export(compressed, (example,))
    if decomposed:
        import coreai_torch

        ep = ep.run_decompositions(coreai_torch.get_decomp_table())
    return ep, example


# ---- what a cast of a compressed program must keep -------------------------------------


def quantized_bytes(ep: torch.export.ExportedProgram) -> dict[str, bytes]:
    """Every int8/uint8 tensor of the program's state (subclasses' inner ones too), as bytes."""
    from fx16.program.tensor_subclasses import inner_tensors

    found = {}
    for name, tensor in (*ep.state_dict.items(), *ep.constants.items()):
        if not isinstance(tensor, torch.Tensor):
            continue
        for inner, leaf in inner_tensors(tensor).items():
            if leaf.dtype in (torch.int8, torch.uint8):
                found[name + inner] = leaf.detach().contiguous().view(torch.uint8).numpy().tobytes()
    return found


def snr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``value`` against ``reference`` in dB (fp64)."""
    reference, value = reference.double(), value.double()
    noise = (reference - value).pow(2).sum().item()
    if noise == 0:
        return float("inf")
    if not torch.isfinite(value).all():
        return float("-inf")
    return 10 * torch.log10(reference.pow(2).sum() / noise).item()


def share_16bit(ep: torch.export.ExportedProgram) -> float:
    """Float compute ops that produce a 16-bit value, among all float compute ops."""
    from fx16.program.stats import program_stats

    stats = program_stats(ep)
    low = stats.ops_in(torch.float16) + stats.ops_in(torch.bfloat16)
    return low / stats.float_ops if stats.float_ops else 1.0


def converts(ep: torch.export.ExportedProgram) -> str:
    """ "yes", or why coreai_torch's TorchConverter does not take the program (it converts
    a copy: the converter rewrites the state of the program it is given)."""
    import copy

    import coreai_torch

    try:
        converter = coreai_torch.TorchConverter()
        converter.add_exported_program(copy.deepcopy(ep))
        converter.to_coreai()
    except Exception as error:  # a refusal is a result
        return f"no ({type(error).__name__})"
    return "yes"
