"""Small models the tests export. Seeded by the tests that build them."""

import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.while_loop import while_loop

from fx16.demo import RMSNorm


class MLP(nn.Module):
    def __init__(self, widths=(8, 16, 4)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class MaskedAttention(nn.Module):
    """Self-attention whose padding mask is filled with ``fill`` (-1e9 or finfo.min)."""

    def __init__(self, width=16, fill=-1e9):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.fill = fill

    def forward(self, x, keep):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~keep[:, None, :], self.fill)
        return self.out(scores.softmax(-1) @ v)


class EmbeddingNormSoftmax(nn.Module):
    def __init__(self, vocab=50, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.proj(self.norm(self.embed(ids))).softmax(-1)


class RMSNormMLP(nn.Module):
    """A Llama-style RMSNorm (explicit ``x.to(torch.float32)``) in front of a linear layer."""

    def __init__(self, width=16, eps=1e-6):
        super().__init__()
        self.norm = RMSNorm(width, eps)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.fc(self.norm(x))


class MixedBuffers(nn.Module):
    """Holds an fp16 buffer, an int8 quantized weight with its scale, and an fp64 buffer."""

    def __init__(self, width=8):
        super().__init__()
        self.register_buffer("half_bias", torch.randn(width).half())
        self.register_buffer("qweight", torch.randint(-127, 127, (width, width), dtype=torch.int8))
        self.register_buffer("scale", torch.full((width,), 0.02))
        self.register_buffer("double_gain", torch.ones(width, dtype=torch.float64))

    def forward(self, x):
        weight = self.qweight.to(torch.float32) * self.scale[:, None]
        y = x @ weight.t() + self.half_bias
        return y, (y.double() * self.double_gain).sum()


class OverflowWeight(nn.Module):
    """One weight holds 1e5 (beyond fp16); another is tiny (below fp16's smallest subnormal)."""

    def __init__(self, width=4):
        super().__init__()
        self.big = nn.Parameter(torch.full((width,), 1e5))
        self.tiny = nn.Parameter(torch.full((width,), 1e-9))
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.fc(x) * 1e-5 * self.big + self.tiny


class CreationOps(nn.Module):
    """Tensors made inside forward: zeros, full, arange, *_like, scalar_tensor."""

    def __init__(self, fill=2.5):
        super().__init__()
        self.fill = fill

    def forward(self, x):
        n = x.shape[-1]
        ramp = torch.arange(n, dtype=torch.float32) / n
        base = torch.zeros(n) + torch.full((n,), self.fill)
        return x * ramp + base + torch.ones_like(x) + torch.scalar_tensor(0.5)


class BufferUpdate(nn.Module):
    """Updates a running buffer in place (BUFFER_MUTATION after run_decompositions):
    accumulates into it (``accumulate``), or writes it over."""

    def __init__(self, width=4, start=0.0, accumulate: bool = True):
        super().__init__()
        self.register_buffer("running", torch.full((width,), start))
        self.accumulate = accumulate

    def forward(self, x):
        if self.accumulate:
            self.running.add_(x.mean(0))
        else:
            self.running.copy_(x.mean(0))
        return x * 2 + self.running


# ---- models with explicit casts, for the cleanup rules (x: fp16 input unless noted) ----


class SameDtypeCast(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float16).relu()


class Widening(torch.nn.Module):
    """x:f16 -> to(f32) -> to(f16) -> relu: the model's own round trip loses nothing."""

    def forward(self, x):
        return x.float().half().relu()


class Narrowing(torch.nn.Module):
    """x:f32 -> to(f16) -> to(f32): the model rounds to fp16 on purpose."""

    def forward(self, x):
        return x.half().float().relu()


class Branching(torch.nn.Module):
    """h = x.float() feeds exp and a cast back to f16."""

    def forward(self, x):
        h = x.float()
        return h.exp(), h.half() + 1


class TwoCasts(torch.nn.Module):
    def forward(self, x):
        return x.float().exp() + x.float().sin()


# ---- integer models ----------------------------------------------------------------


class BucketHash(torch.nn.Module):
    """(ids * 1000 + ids) % 97: coreai-opt wraps the product in int16 and gets wrong buckets."""

    def forward(self, ids):
        return (ids * 1000 + ids) % 97


class Square(torch.nn.Module):
    """a * b: 300 x 300 = 90000 does not fit int16 (coreai-opt returns 24464)."""

    def forward(self, a, b):
        return a * b


class PositionsAndMask(torch.nn.Module):
    """Embedding ids, positions from arange, positions from a mask cumsum, and some
    integer arithmetic on the side that may be narrowed."""

    def __init__(self, vocab=100, width=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)

    def forward(self, ids, mask):
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        from_mask = mask.long().cumsum(-1) - 1
        hidden = self.embed(ids) + self.embed(positions) + self.embed(from_mask.clamp(min=0))
        return hidden, ids % 7 + from_mask, ids * ids


class GatherComputedIndex(torch.nn.Module):
    """The gather index is computed from the input, so all of it must stay wide."""

    def forward(self, x, ids):
        index = (ids + ids) % x.shape[-1]
        return x.gather(-1, index), ids + ids


class Int32Arithmetic(torch.nn.Module):
    """int32 inputs: narrowed results must come back as int32, not int64."""

    def forward(self, a, b):
        return a + b, (a - b) * (a + b)


class CumsumCounter(torch.nn.Module):
    """A running count over a long sequence: cumsum can outgrow int16."""

    def forward(self, steps, offset):
        return (steps + offset).cumsum(-1)


class AutocastRegions(torch.nn.Module):
    """A disabled-autocast region (fp32 on purpose) and an fp16 autocast region."""

    def __init__(self, enabled_dtype=torch.float16):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.inner = torch.nn.Linear(8, 8)
        self.enabled_dtype = enabled_dtype

    def forward(self, x):
        h = self.fc(x)
        with torch.autocast("cpu", enabled=False):
            energy = h.float().pow(2).sum(-1, keepdim=True)
        with torch.autocast("cpu", dtype=self.enabled_dtype):
            g = self.inner(h).relu()
        return h / energy.sqrt() + g.float()


class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)

        def positive(a):
            return a.exp() * 0.5

        def negative(a):
            return a * 1e5  # does not fit fp16: this branch must return fp32

        return torch.cond(h.sum() > 0, positive, negative, (h,)) + 1


class GrowingLoop(torch.nn.Module):
    """A while_loop whose body applies a layer and scales its state by 40 per step:
    after three steps the scaled values pass fp16's range."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        def condition(step, state):
            return step < 3

        def body(step, state):
            return step + 1, torch.tanh(self.fc(state)) * (state.abs() * 40 + 1)

        return while_loop(condition, body, (torch.tensor(0), x))[1]


class MappedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, xs):
        return hop_map(lambda x: self.fc(x).relu(), xs)


class ScaleShiftChain(nn.Module):
    """``steps`` rounds of ``x * scale + shift``: two graph nodes per step."""

    def __init__(self, steps: int, scale: float, shift: float) -> None:
        super().__init__()
        self.steps, self.scale, self.shift = steps, scale, shift

    def forward(self, x):
        for _ in range(self.steps):
            x = x * self.scale + self.shift
        return x
