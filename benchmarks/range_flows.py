"""The range benchmark's models that need more than a module and its inputs: a residual
stream inside a ``torch.cond`` branch, a sum over a dynamic length evaluated at its
bound, a diffusers ``UNet2DModel`` whose convs grow, the quantize-then-cast flows
(coreai-opt's int8 block quantization, torchao's PT2E int8), and a buffer accumulated
over calls. Each builder returns a module ``torch.export`` takes; one with
``export_inputs()`` and ``dynamic_shapes`` is exported (and so calibrated) on those, and
evaluated on the row's inputs; one with ``calls`` is read after that many calls. Builders
whose package is not installed raise ``ImportError``: the row says so."""

import warnings

import torch
from torch import nn
from torch.export import Dim


class PreNormResidual(nn.Module):
    """A pre-norm residual stream whose blocks (weights scaled by ``gain``) grow it past
    fp16's range."""

    def __init__(self, width: int = 16, blocks: int = 3, gain: float = 3e4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.embed = nn.Linear(width, width)
        with torch.no_grad():
            for block in self.blocks:
                block.weight.mul_(gain)

    @staticmethod
    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(self.norm(h))
        return self.norm(h)


class ResidualInACond(nn.Module):
    """The growing residual stream inside one branch of a cond; the other branch a
    linear (``shared``: the stream's embedding instead, a weight both branches read)."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.stream, self.other = PreNormResidual(), nn.Linear(16, 16)
        self.shared = shared

    def forward(self, x, flag):
        other = self.stream.embed if self.shared else self.other
        return torch.cond(flag.sum() > 0, self.stream, other, (x,))


class BagOfEmbeddings(nn.Module):
    """Embeddings in [0, 40] summed over a dynamic number of tokens (at most 4096),
    then a linear; exported and calibrated at 16 tokens."""

    dynamic_shapes = ({1: Dim("seq", min=2, max=4096)},)

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(100, 32), nn.Linear(32, 4)
        with torch.no_grad():
            self.embed.weight.uniform_(0, 40)

    def forward(self, ids):
        return self.head(self.embed(ids).sum(1) / 64.0)

    @staticmethod
    def export_inputs() -> tuple:
        return (torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1)),)


class _Sample(nn.Module):
    def __init__(self, unet) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, x, timestep):
        return self.unet(x, timestep).sample


def growing_unet(gain: float = 8.0) -> nn.Module:
    """A small diffusers ``UNet2DModel`` (two down and two up blocks) whose convs are
    scaled by ``gain``: its activations grow 8x a block, past fp16's range. Needs
    diffusers (``pip install --no-deps diffusers``: its declared dependencies would
    replace torch)."""
    from diffusers import UNet2DModel

    unet = UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )
    with torch.no_grad():
        for module in unet.modules():
            if isinstance(module, nn.Conv2d):
                module.weight.mul_(gain)
    return _Sample(unet)


def unet_inputs() -> tuple:
    return torch.randn(1, 3, 16, 16), torch.tensor([10])


class SmallWeightLinear(nn.Module):
    """A wide Linear whose weights are as small as a trained one's (|w| <= ~4e-4)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(512, 64)
        with torch.no_grad():
            self.linear.weight.mul_(0.1)

    def forward(self, x):
        return self.linear(x)


def coreai_block_quantized() -> nn.Module:
    """``SmallWeightLinear`` after coreai-opt's int8 block quantization, finalized for
    Core AI: its block scales (~3e-6) lie below fp16's normal range. Needs coreai-opt."""
    from coreai_opt import ExportBackend
    from coreai_opt.quantization import Quantizer, QuantizerConfig

    model = SmallWeightLinear().eval()
    quantizer = Quantizer(model, QuantizerConfig(execution_mode="eager"))
    quantizer.prepare(block_quantized_inputs())
    return quantizer.finalize(backend=ExportBackend.CoreAI).eval()


def block_quantized_inputs() -> tuple:
    return (torch.randn(4, 512, generator=torch.Generator().manual_seed(2)),)


class RunningMean(nn.Module):
    """A running mean over calls: two buffers the program accumulates into (read after
    ``calls`` calls on the same input), and a cache written over at a position."""

    calls = 10_000

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("total", torch.zeros(8))
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x):
        h = self.linear(x)
        self.total.add_(h.sum(0))
        self.count.add_(x.shape[0])
        self.cache[1:3].copy_(h[:2])  # written over, as a key/value cache is
        return self.total / self.count, self.cache * 1


def running_mean_inputs() -> tuple:
    return (torch.rand(4, 8, generator=torch.Generator().manual_seed(4)),)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def pt2e_int8_mlp() -> nn.Module:
    """An MLP quantized to int8 with torchao's PT2E flow (XNNPACK's symmetric
    per-channel config): its dequantize ops return fp32 unless told otherwise."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.testing.pt2e import _xnnpack_quantizer as xnnpack

    quantizer = xnnpack.XNNPACKQuantizer().set_global(
        xnnpack.get_symmetric_quantization_config(is_per_channel=True)
    )
    x = mlp_inputs()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_pt2e(torch.export.export(Mlp().eval(), (x,)).module(), quantizer)
        prepared(x)
        return convert_pt2e(prepared)


def mlp_inputs() -> tuple:
    return (torch.randn(8, 16, generator=torch.Generator().manual_seed(3)),)
