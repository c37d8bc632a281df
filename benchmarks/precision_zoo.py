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


def sharpen_qwen3(model, factor: float = 6.0):
    """Scale a Qwen3's q/k norm weights so attention is as peaked as a trained model's."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.mul_(factor)
            layer.self_attn.k_norm.weight.mul_(factor)
    return model


def qwen3_static_cache(layers: int = 2, cache: int = 2048, sharpness: float = 6.0):
    """A small Qwen3 with seeded weights, exported by transformers' on-device export
    (``transformers.integrations.executorch``, static cache of ``cache`` slots).
    Returns (eager module with the same cache, ExportedProgram)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    from transformers.integrations.executorch import (
        TorchExportableModuleWithStaticCache,
        convert_and_export_with_cache,
    )

    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=cache,
    )
    torch.manual_seed(0)
    model = sharpen_qwen3(Qwen3ForCausalLM(config).eval(), sharpness)
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        max_length=cache,
        cache_config={"batch_size": 1, "max_cache_len": cache},
    )
    exported = convert_and_export_with_cache(model)
    return TorchExportableModuleWithStaticCache(model, 1, cache), exported
