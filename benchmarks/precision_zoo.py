"""Models where 16-bit rounding of an op's input is amplified: the precision traps.

Each is built from a config with seeded weights; where random weights would hide
the problem (near-uniform attention), they are scaled as trained models are.
"""

import math

import torch
from torch import nn


class TimestepEmbedding(nn.Module):
    """diffusers' ``get_timestep_embedding`` and the MLP after it (a UNet's time path):
    ``t[:, None].float() * exp(-log(10000) * arange(half) / half)``, then sin/cos."""

    def __init__(self, channels: int = 64, width: int = 128) -> None:
        super().__init__()
        self.channels = channels
        self.mlp = nn.Sequential(nn.Linear(channels, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        half, dtype = self.channels // 2, self.mlp[0].weight.dtype  # float32 as exported
        exponent = -math.log(10000) * torch.arange(half, dtype=dtype) / half
        angles = timesteps[:, None].to(dtype) * torch.exp(exponent)[None, :]
        embedding = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
        return self.mlp(embedding)


class SinusoidalPositions(nn.Module):
    """A transformer's fixed sinusoidal position table, ``arange(seq).float()`` of a
    dynamic sequence length, added to the input projection."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.width = width
        self.project = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1]).to(x.dtype)[:, None]
        frequencies = torch.exp(
            torch.arange(0, self.width, 2).to(x.dtype) * (-math.log(10000.0) / self.width)
        )
        table = torch.cat(
            [torch.sin(positions * frequencies), torch.cos(positions * frequencies)], -1
        )
        return self.project(x + table)


class RotaryAttention(nn.Module):
    """Attention with rotary positions computed without any fp32 cast of the model's
    own: ``positions * inv_freq`` from an integer ``positions`` input that indexes a
    static cache of ``cache`` slots, with sharp (trained-like) attention."""

    def __init__(self, width: int = 64, cache: int = 2048, sharpness: float = 2.0) -> None:
        super().__init__()
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        with torch.no_grad():
            self.q.weight.mul_(sharpness)
            self.k.weight.mul_(sharpness)
        self.register_buffer("inv_freq", 10000.0 ** (-torch.arange(0, width, 2).float() / width))
        self.register_buffer("keys", torch.zeros(cache, width))
        self.register_buffer("values", torch.zeros(cache, width))

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].to(x.dtype) * self.inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, even * sin + odd * cos], -1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k = self.rotate(self.q(x), positions), self.rotate(self.k(x), positions)
        self.keys.index_copy_(0, positions, k)
        self.values.index_copy_(0, positions, self.v(x))
        visible = torch.arange(self.keys.shape[0])[None, :] <= positions[:, None]
        scores = (q @ self.keys.T) / math.sqrt(q.shape[-1])
        weights = scores.masked_fill(~visible, -1e9).softmax(-1)
        return weights @ self.values


# ---- values that flush to zero where an op is singular (fx16.analysis.underflow) ----------


class SharpLogits(nn.Module):
    """A linear layer whose logits are as sharp as a trained LM's: softmax tails
    below 6e-8, fp16's smallest subnormal."""

    def __init__(self, width: int = 32, vocab: int = 256, sharpness: float = 6.0) -> None:
        super().__init__()
        self.head = nn.Linear(width, vocab)
        with torch.no_grad():
            self.head.weight.mul_(sharpness)

    def probabilities(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x).softmax(-1)


class Entropy(SharpLogits):
    """-(p * log p).sum(-1): in fp16 p flushes to 0, log gives -inf, 0 * -inf is nan."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.probabilities(x)
        return -(p * p.log()).sum(-1)


class KLDivergence(nn.Module):
    """KL(p || q) of two sharp softmaxes, from their logs."""

    def __init__(self, width: int = 32, vocab: int = 256, sharpness: float = 6.0) -> None:
        super().__init__()
        self.p, self.q = SharpLogits(width, vocab, sharpness), SharpLogits(width, vocab, sharpness)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, q = self.p.probabilities(x), self.q.probabilities(x)
        return (p * (p.log() - q.log())).sum(-1)


class NegativeLogLikelihood(SharpLogits):
    """-log(softmax(logits))[target], the loss written without log_softmax."""

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return -self.probabilities(x).log().gather(-1, target[:, None]).squeeze(-1)


class Normalized(nn.Module):
    """Rows scaled to unit length, then a linear layer: ``F.normalize(x, eps=1e-12)``,
    or by hand ``x / (x.norm() + eps)``."""

    def __init__(self, width: int = 32, by_hand: bool = False, eps: float = 1e-12) -> None:
        super().__init__()
        self.by_hand, self.eps = by_hand, eps
        self.project = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.by_hand:
            return self.project(x / (x.norm(dim=-1, keepdim=True) + self.eps))
        return self.project(torch.nn.functional.normalize(x, dim=-1, eps=self.eps))


class RMSNormEps(nn.Module):
    """An RMSNorm written in the model's dtype, ``x * rsqrt(mean(x^2) + eps)``, with a
    tiny eps (1e-12 flushes to zero in fp16), then a linear layer."""

    def __init__(self, width: int = 32, eps: float = 1e-12) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))
        self.project = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.project(x * scale * self.weight)


# ---- cancellation inside ops that subtract a mean (fx16.analysis.centering) ---------------


def offset_features(
    rows: int, means: torch.Tensor, spreads: torch.Tensor, seed: int
) -> torch.Tensor:
    """Raw tabular or sensor features: column j is means[j] +- spreads[j]."""
    generator = torch.Generator().manual_seed(seed)
    return means + spreads * torch.randn(rows, len(means), generator=generator)


TABULAR_MEANS = torch.linspace(1000.0, 5000.0, 8)  # timestamps, prices
TABULAR_SPREADS = torch.linspace(0.5, 5.0, 8)


class TabularBatchNorm(nn.Module):
    """``nn.BatchNorm1d`` (inference) on raw features, then an MLP; its running
    statistics are the features' (means 1000-5000, spreads 0.5-5)."""

    def __init__(self, means=TABULAR_MEANS, spreads=TABULAR_SPREADS) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(len(means))
        with torch.no_grad():
            self.norm.running_mean.copy_(means)
            self.norm.running_var.copy_(spreads**2)
        self.mlp = nn.Sequential(nn.Linear(len(means), 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x))


class Standardized(nn.Module):
    """``(x - mean) / std`` by the feature statistics a model keeps as buffers."""

    def __init__(self, means=TABULAR_MEANS, spreads=TABULAR_SPREADS) -> None:
        super().__init__()
        self.register_buffer("mean", means.clone())
        self.register_buffer("std", spreads.clone())
        self.mlp = nn.Sequential(nn.Linear(len(means), 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp((x - self.mean) / self.std)


class NormOfOffsetData(nn.Module):
    """A normalization (``layer``, ``group`` or ``instance``) of data far from zero
    (sensor readings around 3000), then a linear layer. The group and instance norms
    read (batch, 4 * width) as ``width`` channels of 4 readings."""

    def __init__(self, kind: str = "layer", width: int = 16) -> None:
        super().__init__()
        self.kind = kind
        norms = {
            "layer": lambda: nn.LayerNorm(width),
            "group": lambda: nn.GroupNorm(4, width),
            "instance": lambda: nn.InstanceNorm1d(width, affine=True),
        }
        self.norm = norms[kind]()
        self.project = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return self.project(self.norm(x))
        channels = x.unflatten(-1, (self.project.in_features, -1))  # (batch, width, 4)
        return self.project(self.norm(channels).mean(-1))


class SpreadOfOffsetData(nn.Module):
    """The spread of readings around an offset: ``x.std(-1)`` (``unbiased``), or by
    hand, ``sqrt(E[x^2] - E[x]^2)`` - which goes negative, then nan, when x * x is
    rounded to fp16's spacing of 8 at 10,000."""

    def __init__(self, by_hand: bool = False) -> None:
        super().__init__()
        self.by_hand = by_hand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.by_hand:
            return ((x * x).mean(-1) - x.mean(-1) ** 2).sqrt()
        return x.std(-1)


# ---- rotary LLMs with a static cache, as transformers exports them for devices -----------

ROPE_LLMS = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "mistral")


def rope_llm(name: str, cache: int = 2048, sharpness: float = 1.5, layers: int = 2):
    """A small transformers causal LM of architecture ``name`` (one of ``ROPE_LLMS``),
    seeded, with attention as peaked as a trained model's (q/k norm weights, or q and k
    projections, scaled by ``sharpness``), wrapped for on-device export with a static
    cache of ``cache`` slots (``TorchExportableModuleWithStaticCache``): (input_ids,
    cache_position) -> logits."""
    import transformers
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=cache,
    )
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, {"head_dim": 16}),
        "gemma3": (
            transformers.Gemma3TextConfig,
            transformers.Gemma3ForCausalLM,
            {"head_dim": 16},
        ),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"pad_token_id": 0}),
        "mistral": (
            transformers.MistralConfig,
            transformers.MistralForCausalLM,
            {"sliding_window": None},
        ),
    }
    config_class, model_class, extra = configs[name]
    torch.manual_seed(0)
    model = model_class(config_class(**common, **extra)).eval()
    _sharpen(model, sharpness)
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        max_length=cache,
        cache_config={"batch_size": 1, "max_cache_len": cache},
    )
    return TorchExportableModuleWithStaticCache(model, 1, cache)


def _sharpen(model, factor: float) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            if hasattr(attention, "q_norm"):
                attention.q_norm.weight.mul_(factor)
                attention.k_norm.weight.mul_(factor)
            elif hasattr(attention, "qkv_proj"):  # phi3: q, k and v in one projection
                rows = attention.qkv_proj.weight.shape[0]
                attention.qkv_proj.weight[: 2 * rows // 3].mul_(factor)
            else:
                attention.q_proj.weight.mul_(factor)
                attention.k_proj.weight.mul_(factor)


def prefill_caches(step, programs, ids: torch.Tensor) -> None:
    """Run ``step`` (the eager wrapper) on every id at once, then copy its caches into
    each exported program's module in ``programs`` (in the dtype each holds them):
    decoding can then start anywhere, without a step per position."""
    with torch.no_grad():
        step(input_ids=ids, cache_position=torch.arange(ids.shape[1]))
    buffers = dict(step.named_buffers())
    for module in programs:
        for name, buffer in module.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name].to(buffer.dtype))


DECODE_POSITIONS = (1500, 1750, 2000, 2040)


def decode_outputs(step, cast, positions=DECODE_POSITIONS) -> list[tuple]:
    """(fp32, cast) logits of one decode step at each of ``positions``, after one
    prefill of every position before the last: ``step`` is the eager module that was
    exported, ``cast`` the cast ExportedProgram."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (1, max(positions) + 1), generator=generator)
    module = cast.module()
    prefill_caches(step, [module], ids)
    found = []
    with torch.no_grad():
        for position in positions:
            token, where = ids[:, position : position + 1], torch.tensor([position])
            found.append(
                (
                    step(input_ids=token, cache_position=where),
                    module(input_ids=token, cache_position=where),
                )
            )
    return found
