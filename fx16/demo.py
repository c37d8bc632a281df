"""``python -m fx16 demo``: cast a small built-in transformer block and show what changed."""

import copy
import sys
import time
import warnings
from typing import TextIO

import torch
import torch.nn.functional as F
from torch import nn

from fx16.casting import cast_fp32_to_fp16
from fx16.program.stats import program_stats, relative_error


class RMSNorm(nn.Module):
    """The Llama-family norm: the variance is computed in an explicit fp32 region."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DemoBlock(nn.Module):
    """Embedding, RMSNorm, causal self-attention with a finfo.min mask, GELU MLP, LM head."""

    def __init__(self, vocab: int = 512, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, width)
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (width // self.heads) ** 0.5
        future = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(future, torch.finfo(torch.float32).min)
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(attended)
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.head(x)


def run_demo(out: TextIO | None = None) -> float:
    """Export, cast and compare the demo block; print a before/after table to ``out``
    (default: ``sys.stdout`` as it is when called). Returns the error."""
    out = out if out is not None else sys.stdout
    torch.manual_seed(0)
    model = DemoBlock().eval()
    input_ids = torch.randint(0, 512, (2, 16))
    ep = torch.export.export(model, (input_ids,))
    before = program_stats(ep)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(input_ids)
    fp32_error = relative_error(reference, ep.module()(input_ids))

    with warnings.catch_warnings():  # torch's own deepcopy of the pytree specs warns
        warnings.simplefilter("ignore", FutureWarning)
        cast = copy.deepcopy(ep)
    start = time.perf_counter()
    cast_fp32_to_fp16(cast)
    seconds = time.perf_counter() - start
    after = program_stats(cast)
    error = relative_error(reference, cast.module()(input_ids))

    rows = [
        (
            "matmul/attention FLOPs 16-bit",
            f"{before.flop_share_16bit:.0%}",
            f"{after.flop_share_16bit:.0%}",
        ),
        ("weight bytes", before.weight_bytes, after.weight_bytes),
        ("casts", before.casts, after.casts),
        ("  of which inserted by fx16", before.inserted_casts, after.inserted_casts),
        ("ops computing in fp32", before.ops_in(torch.float32), after.ops_in(torch.float32)),
        ("ops computing in fp16", before.ops_in(torch.float16), after.ops_in(torch.float16)),
        ("max relative error vs fp64", f"{fp32_error:.2e}", f"{error:.2e}"),
    ]
    print("fx16 demo: transformer block (embedding, RMSNorm, causal attention, MLP)", file=out)
    print(f"{'':30}{'fp32':>12}{'fx16':>12}", file=out)
    for name, old, new in rows:
        print(f"{name:30}{old:>12}{new:>12}", file=out)
    print(
        f"weights: {after.weight_bytes / before.weight_bytes:.2f}x; "
        f"cast took {seconds * 1e3:.1f} ms",
        file=out,
    )
    return error
