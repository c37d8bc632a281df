"""Range: models whose values leave fp16's range, at either end, cast side by side.

For each model, fx16's default cast, eager ``.half()``, eager bf16 autocast and
coreai-opt: the largest relative error of an output against an fp64 run, the outputs
that turn inf or NaN where fp64 is finite, the share of matmul/conv/attention FLOPs in
16-bit, the ops left in fp32 and the casts the cast program runs per call (the eager
peers have no program: "-"). An in-range twin (the same architecture with its values
inside fp16's range) gives the error the range goal compares against. Writes
``benchmarks/RANGE.md``.
"""

import argparse
import copy
import math
import warnings
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import nn

import fx16
from benchmarks import range_flows, zoo
from benchmarks.markdown import table_row, write_results
from benchmarks.runtime_count import RuntimeCount
from fx16.program import Program
from fx16.program.stats import program_stats, relative_error


class TinyWeights(nn.Module):
    """A product with weights of 1e-9 (every one below fp16's subnormals), then a
    reciprocal and a scale back up, as a calibrated sensor gain might be stored."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(32, 32) * 1e-9)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        y = x @ self.gain
        return self.head(y * 1e6), 1 / y


class RawUnits(nn.Module):
    """A tabular MLP fed raw units (incomes, populations: up to ~1e6)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        with torch.no_grad():
            self.layers[0].weight.mul_(1e-5)

    def forward(self, x):
        return self.head(self.layers(x))


class GrowingCnn(nn.Module):
    """conv -> BatchNorm (eval: a per-channel affine) -> ReLU, six times, each block
    multiplying the activations by about 8 (inception-like growth past fp16's range);
    ``gain=1``, the BatchNorms' weights 8x smaller, keeps them inside it (the twin)."""

    def __init__(self, blocks: int = 6, gain: float = 8.0) -> None:
        super().__init__()
        layers = []
        for _ in range(blocks):
            conv, norm = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
            with torch.no_grad():
                norm.weight.fill_(gain)
                norm.running_var.fill_(0.05)
            layers += [conv, norm, nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class LoudAttention(nn.Module):
    """Self-attention whose logits reach ~3e5 (query and key weights x150): the softmax
    must read them unscaled, so no power-of-two scale carries them through fp16."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        with torch.no_grad():
            self.q.weight.mul_(150)
            self.k.weight.mul_(150)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.out(scores.softmax(-1) @ self.v(x))


class RawReadings(nn.Module):
    """A recurrent layer (two layers) over raw sensor readings (~1e5), trained for them:
    its first layer's input weights are ~1e-6, below fp16's normal range."""

    def __init__(self, kind=nn.LSTM, bidirectional: bool = False) -> None:
        super().__init__()
        self.rnn = kind(8, 16, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(16 * (2 if bidirectional else 1), 4)
        with torch.no_grad():
            for name, weight in self.rnn.named_parameters():
                if name.startswith("weight_ih_l0"):
                    weight.mul_(1e-5)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class GrowingConvs(nn.Module):
    """Convs with biases, each block growing about 8x past fp16's range (1e7 after ten
    blocks), then a strided conv and a transposed one, a skip and a GroupNorm: the
    domain reaches 2**-11, where the later convs' biases (|b| <= 0.2) fold below fp16's
    normal range."""

    def __init__(self, blocks: int = 10) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(blocks))
        self.down, self.up = nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ConvTranspose2d(8, 8, 2, 2)
        with torch.no_grad():
            for conv in self.convs:
                conv.weight.mul_(8 / conv.weight.std() / 72**0.5)

    def forward(self, x):
        for conv in self.convs:
            x = torch.relu(conv(x))
        return nn.functional.group_norm(self.up(torch.relu(self.down(x))) + x, 2)


class SinkAttention(nn.Module):
    """Self-attention whose first token has a huge hidden state: every head attends to
    it, with raw ``q kᵀ`` ~1e5 (past fp16 over the margin) and logits ~3e4 after the
    ``1/sqrt(d)`` (inside). ``rope``: q and k rotated (``q cos + rotate_half(q) sin``);
    ``by_multiply``: the logits scaled by a multiply rather than a division; ``softcap``:
    Gemma-2's soft-capping of the logits, ``softcap * tanh(logits / softcap)``."""

    def __init__(
        self,
        rope: bool = False,
        by_multiply: bool = False,
        width: int = 64,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.softcap = softcap
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out, self.heads, self.rope, self.by_multiply = (
            nn.Linear(width, width),
            4,
            rope,
            by_multiply,
        )
        with torch.no_grad():
            self.q.weight.mul_(8)
            self.k.weight.mul_(8)

    def forward(self, x):
        batch, length, width = x.shape
        size = width // self.heads

        def heads(t):
            return t.view(batch, length, self.heads, size).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        if self.rope:
            angle = torch.arange(length)[:, None] * torch.arange(size // 2)[None] * 0.1
            cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)

            def rotated(t):
                return t * cos + torch.cat([-t[..., size // 2 :], t[..., : size // 2]], -1) * sin

            q, k = rotated(q), rotated(k)
        scores = q @ k.transpose(-1, -2)
        if self.by_multiply:
            scores = scores * (1 / math.sqrt(size))
        else:
            scores = scores / math.sqrt(size)
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        weights = torch.softmax(scores, dim=-1)
        return self.out((weights @ v).transpose(1, 2).reshape(batch, length, width))


class MaskedScores(nn.Module):
    """A Linear gives scores, a mask fills some with ``fill`` (``how``), softmax."""

    def __init__(self, fill: float = -1e9, how: str = "masked_fill", scale: float = 1.0) -> None:
        super().__init__()
        self.scores, self.fill, self.how, self.scale = nn.Linear(16, 12), fill, how, scale

    def forward(self, x, mask):
        scores = self.scores(x) * self.scale
        if self.how == "masked_fill":
            scores = scores.masked_fill(~mask, self.fill)
        elif self.how == "where":
            scores = torch.where(mask, scores, self.fill)
        else:  # a mask tensor added to the scores
            scores = scores + torch.full_like(scores, self.fill) * (~mask)
        return torch.softmax(scores, dim=-1)


def models():
    """(name, build, inputs, twin): twin is the in-range model's name, or None."""

    def ids():
        return (zoo.massive_ids(),)

    return [
        (
            "T5 v1.1 encoder, residual ~2e3 (in range)",
            lambda: zoo.massive_t5_encoder(2e3),
            ids,
            None,
        ),
        ("T5 v1.1 encoder, residual ~3e4", lambda: zoo.massive_t5_encoder(3e4), ids, "T5"),
        ("T5 v1.1 encoder, residual ~3e5", lambda: zoo.massive_t5_encoder(3e5), ids, "T5"),
        ("T5 v1.1 encoder, residual ~3e6", lambda: zoo.massive_t5_encoder(3e6), ids, "T5"),
        (
            "Llama, massive activations ~2e3 (in range)",
            lambda: zoo.massive_llama(3, 2e3),
            ids,
            None,
        ),
        ("Llama, massive activations ~2e5", lambda: zoo.massive_llama(3, 2e5), ids, "Llama"),
        ("tiny weights (1e-9)", TinyWeights, lambda: (torch.randn(4, 32),), None),
        ("raw-unit inputs (~1e6)", RawUnits, lambda: (torch.rand(8, 16) * 1e6,), None),
        ("bf16 Llama cast to fp16", lambda: zoo.llama(2).to(torch.bfloat16), ids, None),
        (
            "attention logits ~3e5, read unscaled by softmax",
            LoudAttention,
            lambda: (torch.randn(2, 16, 64),),
            None,
        ),
        (
            "CNN, BatchNorm weights 1 (in range)",
            lambda: GrowingCnn(gain=1.0).eval(),
            lambda: (torch.randn(2, 8, 8, 8),),
            None,
        ),
        (
            "growing CNN (x8 a block)",
            lambda: GrowingCnn().eval(),
            lambda: (torch.randn(2, 8, 8, 8),),
            "CNN",
        ),
        (
            "growing convs with biases (to 4e7), down/upsampler",
            GrowingConvs,
            lambda: (torch.randn(2, 8, 16, 16),),
            None,
        ),
        ("LSTM on raw readings (~1e5)", RawReadings, lambda: (torch.randn(4, 12, 8) * 1e5,), None),
        (
            "attention sink, BERT-like (q k^T ~2e5, logits ~2e4)",
            lambda: SinkAttention(width=256),
            _sink_input,
            None,
        ),
        (
            "attention sink, RoPE (q k^T ~2e5, logits ~2e4)",
            lambda: SinkAttention(rope=True, width=256),
            _sink_input,
            None,
        ),
        (
            "attention sink, Gemma-2-style (RoPE, logits soft-capped at 50)",
            lambda: SinkAttention(rope=True, by_multiply=True, width=256, softcap=50.0),
            _sink_input,
            None,
        ),
        ("scores.masked_fill(~mask, -1e9)", MaskedScores, _masked_input, None),
        (
            "residual stream to 8e4 inside a cond branch",
            lambda: range_flows.ResidualInACond().eval(),
            lambda: (torch.randn(4, 16), torch.ones(1)),
            None,
        ),
        (
            "bag of embeddings over a dynamic length, at its bound (4096; calibrated at 16)",
            range_flows.BagOfEmbeddings,
            lambda: (torch.randint(0, 100, (2, 4096)),),
            None,
        ),
        (
            "diffusers UNet2DModel, convs x8",
            range_flows.growing_unet,
            range_flows.unet_inputs,
            None,
        ),
        (
            "coreai-opt int8 blocks, scales ~3e-6 (quantize, then cast)",
            range_flows.coreai_block_quantized,
            range_flows.block_quantized_inputs,
            None,
        ),
        ("PT2E int8 MLP (torchao)", range_flows.pt2e_int8_mlp, range_flows.mlp_inputs, None),
        (
            "running mean in a buffer, after 10,000 calls",
            range_flows.RunningMean,
            range_flows.running_mean_inputs,
            None,
        ),
    ]


def _sink_input() -> tuple:
    """Hidden states whose first token is 20x the others: every head (of 64 features)
    attends to it."""
    x = torch.randn(2, 16, 256)
    x[:, 0] *= 20
    return (x,)


def _masked_input() -> tuple:
    mask = torch.rand(4, 12) > 0.3
    mask[:, 0] = True  # every row keeps one score
    return torch.randn(4, 16), mask


def _floats64(args):
    return [a.double() if a.is_floating_point() else a for a in args]


def _reference(model, args) -> list:
    """The model in fp64 (a bf16 model's weights widened exactly); a PT2E int8 model
    (an exported graph, whose quantize ops take only fp32), in fp32."""
    with torch.no_grad():
        if isinstance(model, torch.fx.GraphModule):
            return pytree.tree_leaves(model(*args))
        return _last_call(copy.deepcopy(model).double(), _floats64(args), model)


def _last_call(run, args, model) -> list:
    """``run(*args)``'s outputs after the model's number of calls (``calls``, else 1):
    the calls before the last leave their state behind, uncounted."""
    for _ in range(getattr(model, "calls", 1) - 1):
        run(*args)
    return pytree.tree_leaves(run(*args))


def _outcome(reference, outputs) -> tuple[str, str]:
    errors, broken = [], 0
    for ref, out in zip(reference, outputs):
        if isinstance(ref, torch.Tensor) and ref.is_floating_point():
            errors.append(relative_error(ref, out.double()))
            broken += int((torch.isfinite(ref) & ~torch.isfinite(out.double())).sum())
    return f"{max(errors):.2e}", str(broken)


def _export(model, args):
    """The model exported on its rows' inputs, or on its own shorter ones where a
    dimension is dynamic (``range_flows.BagOfEmbeddings``: calibrated there)."""
    if hasattr(model, "export_inputs"):
        return torch.export.export(
            model, model.export_inputs(), dynamic_shapes=model.dynamic_shapes
        )
    return torch.export.export(model, args)


def _counted(run) -> tuple[str, str]:
    """The 16-bit share of the products' FLOPs and the bytes dtype conversions move,
    counted at the dispatcher while ``run()`` runs (``benchmarks.runtime_count``)."""
    with torch.no_grad(), RuntimeCount() as counted:
        outputs = run()
    share = counted.share_16bit
    return outputs, f"{share:.1%}" if share is not None else "-", f"{counted.cast_bytes:,}"


def _program_row(cast, model, args, reference) -> list[str]:
    ep = _export(model, args)
    cast(ep)
    stats = program_stats(ep)
    program = Program(ep)
    call, _ = program.adapt_call(args, None)  # the inputs in the program's dtypes, as sent
    if hasattr(model, "calls"):  # its state carried from call to call
        module = ep.module()
        for _ in range(model.calls - 1):
            module(*call)
        outputs, share, moved = _counted(lambda: pytree.tree_leaves(module(*call)))
    else:
        outputs, share, moved = _counted(lambda: program.run(call))
    error, broken = _outcome(reference, outputs)
    return [
        error,
        broken,
        f"{stats.flop_share_16bit:.1%}",
        share,
        str(stats.ops_in(torch.float32)),
        str(stats.casts),
        moved,
    ]


def _eager_row(run, model, args, reference, prepare=lambda model: model) -> list[str]:
    """An eager peer, ``prepare`` (the model's one-time conversion) outside the count."""
    prepared = prepare(model)
    for _ in range(getattr(model, "calls", 1) - 1):
        run(prepared, args)
    outputs, share, moved = _counted(lambda: pytree.tree_leaves(run(prepared, args)))
    return [*_outcome(reference, outputs), "-", share, "-", "-", moved]


def _half(model, args):
    return model(*[a.half() if a.is_floating_point() else a for a in args])


def _halved(model):
    return copy.deepcopy(model).half()


def _autocast(model, args):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(*args)


def _retargeting(ep) -> None:
    """fx16 as cast for the Neural Engine: the model's own fp32 regions retargeted to
    16-bit unless the calibration inputs show they need fp32."""
    fx16.cast_fp32_to_fp16(ep, explicit_fp32="calibrated")


def _bf16_fallback(ep) -> None:
    """fx16 for a target with both 16-bit dtypes: what no scale carries in bf16."""
    fx16.cast_fp32_to_fp16(ep, range_fallback="bf16")


def tools() -> dict:
    found = {"fx16": lambda *a: _program_row(fx16.cast_fp32_to_fp16, *a)}
    found['fx16, explicit_fp32="calibrated"'] = lambda *a: _program_row(_retargeting, *a)
    found['fx16, range_fallback="bf16"'] = lambda *a: _program_row(_bf16_fallback, *a)
    found["eager .half()"] = lambda *a: _eager_row(_half, *a, prepare=_halved)
    found["eager autocast bf16"] = lambda *a: _eager_row(_autocast, *a)
    try:
        from coreai_opt.casting import cast_fp32_to_fp16
    except ImportError:
        return found
    found["coreai-opt 0.3.0"] = lambda *a: _program_row(cast_fp32_to_fp16, *a)
    return found


NOTES = (
    "Errors against an fp64 run of the model (a bf16 model's weights widened "
    "exactly); casts per call count every cast node of the cast program. The rows "
    "marked in range are the twins the range goal compares with. fx16's default keeps "
    "the model's own fp32 regions (T5's and Llama's RMSNorm variances, Llama's fp32 "
    "softmax) as `.half()` does, so they count as fp32 ops; "
    '`explicit_fp32="calibrated"` (for the Neural Engine) retargets them to 16-bit '
    "where calibration shows they fit. "
    '`range_fallback="bf16"` (for targets with both 16-bit dtypes) computes in bf16 '
    "what no power-of-two scale carries, where the default keeps it fp32. The one "
    "fp32 op of the tiny weights and of the growing CNN is the multiply that undoes "
    "the scale at the output, whose values (1e10, 2.5e6) are the model's answer and "
    "beyond fp16; that of the raw-unit inputs and of the LSTM on raw readings is the "
    "scale at the door (the LSTM's first-layer input weights take it back, folded). "
    "The attention sinks' q k^T takes its scale from q's projection (weight and bias "
    "folded), undone in the 1/sqrt(d); the -1e9 mask fill is carried as a sentinel; "
    "the growing convs' biases folded below fp16's normal range stay 16-bit. "
    "The residual stream inside a cond branch is scaled in the branch (its weights "
    "folded). The bag of embeddings is exported and calibrated at 16 tokens and run at "
    "4096, its dynamic length's bound, where its sums pass fp16's range: fx16 judged "
    "them there. The quantized rows (coreai-opt's int8 blocks: errors include the "
    "output's int8 step; PT2E: measured against the int8 program in fp32, which takes "
    "no fp64) keep their int8 weights; the block scales below fp16's range are carried "
    "at a power of two. The running mean is read after 10,000 calls on one input; its "
    "three fp32 ops are the running state (16-bit would round updates away after ~2048 "
    "calls). '16-bit FLOP share, counted' is measured at the dispatcher while the "
    "program runs (`benchmarks/runtime_count.py`: torch's FLOP formulas by the dtype "
    "each product computes in), independently of fx16's cost model; 'bytes cast per "
    "call' are what dtype conversions read and write in one call (the eager peers': "
    "autocast's per-call weight casts; `.half()` converts the model once, outside)."
)

COMMAND = "python -m benchmarks.range"
HEADER = (
    "| model | tool | max rel. error vs fp64 | outputs turned inf/nan | 16-bit FLOP share | "
    "16-bit FLOP share, counted | fp32 ops | casts per call | bytes cast per call |"
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("RANGE.md"))
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    lines = [HEADER, "|" + "---|" * 9]
    for name, build, draw, _ in models():
        torch.manual_seed(0)
        model, args = build(), tuple(draw())
        if not isinstance(model, torch.fx.GraphModule):  # PT2E's converted graph: no eval()
            model.eval()
        reference = _reference(model, args)
        for tool, run in tools().items():
            if tool == "eager autocast bf16" and next(model.parameters()).dtype == torch.bfloat16:
                continue
            try:  # each tool on its own copy: a model may change its state as it runs
                cells = run(copy.deepcopy(model), args, reference)
            except Exception as error:  # a peer that cannot cast the model says so
                cells = [f"fails: {type(error).__name__}", *["-"] * 6]
            lines.append(table_row([name, tool, *cells]))
            print(lines[-1], flush=True)
    write_results(options.output, "Range: values beyond fp16 at either end", COMMAND, NOTES, lines)


if __name__ == "__main__":
    main()
