"""Inputs that differ from the calibration inputs the way real data does: fx16 beside its peers.

    python -m benchmarks.shift [--output benchmarks/SHIFT.md]

Each float-input model (the benchmark zoo's and the trap models of
``benchmarks.shift_traps`` and ``benchmarks.precision_zoo``) is exported and cast on
one draw of its data (the calibration inputs: torch.export's example), then run on
another draw, shifted: scaled x2, x3 and x0.01, half its rows near-silent (x1e-3), a
third of its rows constant, the middle third of each row held at its first value (a
stalled sensor, a constant stretch of audio), one outlier row (x10), an offset per
column. Error: max |fp64 - tool| / max |fp64| over the outputs fp32 and fp64 hold
finite ("non-finite" where a tool gives inf or nan where fp32 and fp64 do not), for
fx16's default cast, eager ``.half()``, eager ``torch.autocast`` (CPU, fp16) and
coreai-opt 0.3.0's ``cast_fp32_to_fp16``, with fx16's 16-bit share of
matmul/conv/attention FLOPs beside it.

Envelope: whether the shifted input stays inside what fx16's decisions assumed. fx16's
analyses and safety rules are run again with the shifted input as the calibration;
the shift is inside when every value they would keep fp32 for it is fp32 (or
rewritten) in the cast made on the calibration inputs, and outside otherwise (the
column names what it would need). Goal: inside the envelope, fx16 within
``TOLERANCE`` of fp64 and never non-finite where fp32 and fp64 are finite.
"""

import argparse
import copy
import warnings
from pathlib import Path

import torch

import fx16
from benchmarks import precision_zoo, shift_traps, zoo
from benchmarks.markdown import table_row, write_results
from benchmarks.safety_traps import fp64_outputs
from fx16.analysis import Fp32RulesAnalysis
from fx16.analysis.fp32_rules import fp32_rule
from fx16.pipelines import fp16_stages
from fx16.policy.options import Fp16Options
from fx16.program import Program
from fx16.program.nodes import node_val
from fx16.program.subgraphs import nested_graph_modules
from fx16.report import report_of

TOLERANCE = 3e-3
PEER = "coreai-opt 0.3.0"


def _normal(*shape):
    return lambda seed: torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def models():
    """(name, build, draw(seed) -> the model's one float input)."""
    offsets = precision_zoo.TABULAR_MEANS, precision_zoo.TABULAR_SPREADS
    yield "ViT (pixels)", zoo.vit, _normal(4, 3, 32, 32)
    yield "Whisper encoder (mel frames)", zoo.whisper_encoder, _normal(4, 16, 64)
    yield "ResNet-ish CNN", zoo.ResNetish, _normal(4, 3, 16, 16)
    yield (
        "tabular batch norm",
        precision_zoo.TabularBatchNorm,
        lambda seed: precision_zoo.offset_features(64, *offsets, seed),
    )
    yield (
        "standardized by buffers",
        precision_zoo.Standardized,
        lambda seed: precision_zoo.offset_features(64, *offsets, seed),
    )
    yield "entropy of sharp logits", precision_zoo.Entropy, _normal(16, 32)
    yield "normalized rows (eps 1e-12)", precision_zoo.Normalized, _normal(16, 32)
    yield "entropy of a softmax tail", shift_traps.TailEntropy, _normal(64, 16)
    yield "log of a sigmoid", shift_traps.LogLikelihood, _normal(64, 16)
    yield "RMSNorm of audio frames", shift_traps.FrameRmsNorm, _frames
    yield (
        "RMSNorm of audio frames, x / sqrt",
        lambda: shift_traps.FrameRmsNorm(divide=True),
        _frames,
    )
    yield "STFT magnitude of audio frames", shift_traps.StftMagnitude, _frames
    yield "voice activity (waveform)", shift_traps.VoiceActivity, _waveforms
    yield "peak-normalized audio frames", shift_traps.PeakNormalized, _frames
    yield (
        "standardized mixed columns",
        shift_traps.MixedColumns,
        lambda seed: shift_traps.mixed_columns(64, seed),
    )


def _frames(seed: int) -> torch.Tensor:
    return shift_traps.audio_frames(32, seed)


def _waveforms(seed: int) -> torch.Tensor:
    return shift_traps.speech(4, seed)


def _rows(x: torch.Tensor, share: float) -> slice:
    """The first ``share`` of the rows (dim 0), at least one."""
    return slice(0, max(1, int(x.shape[0] * share)))


def _quiet_rows(x):
    x = x.clone()
    x[_rows(x, 0.5)] *= 1e-3
    return x


def _constant_rows(x):
    x = x.clone()
    rows = _rows(x, 1 / 3)
    x[rows] = x[rows].mean(dim=tuple(range(1, x.dim())), keepdim=True).expand_as(x[rows])
    return x


def _outlier_row(x):
    x = x.clone()
    x[_rows(x, 0)] *= 10
    return x


def _column_offsets(x):
    generator = torch.Generator().manual_seed(99)
    offsets = (2 * torch.rand(x.shape[-1], generator=generator) - 1) * 5 * x.std()
    return x + offsets


SHIFTS = {
    "none": lambda x: x,
    "x2": lambda x: 2 * x,
    "x3": lambda x: 3 * x,
    "x0.01": lambda x: 0.01 * x,
    "quiet rows": _quiet_rows,
    "constant rows": _constant_rows,
    "constant stretches": shift_traps.constant_stretches,
    "outlier row": _outlier_row,
    "column offsets": _column_offsets,
}


def _peer():
    try:
        from coreai_opt.casting import cast_fp32_to_fp16
    except ImportError:
        return None
    return cast_fp32_to_fp16


def _run_program(ep, x) -> torch.Tensor:
    with torch.no_grad():
        return ep.module()(*Program(ep).adapt_call((x,))[0])


def _eager(model, x, how: str) -> torch.Tensor:
    with torch.no_grad():
        if how == ".half()":
            return model(x.half())
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x)


def fp32_needed(ep, x) -> set[str]:
    """The values fx16's analyses and safety rules keep fp32 when calibrated on ``x``
    (the rewrites applied first, so the names are the cast program's)."""
    probe = copy.deepcopy(ep)
    stages = fp16_stages(probe, Fp16Options(calibration=[(x,)]))
    for stage in (*stages.before_decisions, stages.find(Fp32RulesAnalysis)):
        stage(probe.graph_module)
    return {
        node.name
        for module in nested_graph_modules(probe.graph_module)
        for node in module.graph.nodes
        if fp32_rule(node) is not None
    }


def left_16_bit(cast, names: set[str]) -> list[str]:
    """Those of ``names`` the cast program computes in 16-bit."""
    return sorted(
        node.name
        for module in nested_graph_modules(cast.graph_module)
        for node in module.graph.nodes
        if node.name in names
        and isinstance(node_val(node), torch.Tensor)
        and node_val(node).dtype in (torch.float16, torch.bfloat16)
    )


def judge(want: torch.Tensor, fp32: torch.Tensor, got: torch.Tensor) -> tuple[float, int]:
    """(max |want - got| / max |want| where fp32, fp64 and ``got`` are finite, how many
    elements of ``got`` are inf or nan where fp32's and fp64's are finite): a value fp32
    itself cannot hold (an exp that underflows fp32 under a log) is no 16-bit loss."""
    want, got = want.double(), got.double()
    holds = torch.isfinite(fp32) & torch.isfinite(want)
    bad = int((~torch.isfinite(got) & holds).sum())
    finite = holds & torch.isfinite(got)
    if not finite.any():
        return 1.0, bad
    return float((want - got)[finite].abs().max() / want[finite].abs().max()), bad


def _cell(result) -> str:
    error, bad = result
    return "non-finite" if bad else f"{error:.2e}"


def measure() -> list[str]:
    peer = _peer()
    lines = [
        table_row(
            [
                "model",
                "shift",
                "fx16",
                ".half()",
                "autocast",
                PEER,
                "fx16 16-bit FLOPs",
                "envelope",
                "goal",
            ]
        ),
        "|" + "---|" * 9,
    ]
    for name, build, draw in models():
        torch.manual_seed(0)
        model = build().eval()
        example = draw(1)
        ep = torch.export.export(model, (example,))
        cast = fx16.cast_fp32_to_fp16(copy.deepcopy(ep))
        share = f"{report_of(cast).totals.flop_share_16bit:.2%}"
        peer_cast = peer(copy.deepcopy(ep)) if peer is not None else None
        half = copy.deepcopy(model).half()
        for shift, apply in SHIFTS.items():
            x = apply(draw(2))
            want = fp64_outputs(model, (x,))
            with torch.no_grad():
                fp32 = model(x)

            def judged(got, want=want, fp32=fp32):
                return judge(want, fp32, got)

            ours = judged(_run_program(cast, x))
            others = [judged(_eager(half, x, ".half()")), judged(_eager(model, x, "autocast"))]
            peer_cell = _cell(judged(_run_program(peer_cast, x))) if peer_cast else "-"
            missing = left_16_bit(cast, fp32_needed(ep, x))
            inside = not missing
            envelope = "inside" if inside else "outside: " + ", ".join(missing[:4])
            held = ours[1] == 0 and ours[0] <= TOLERANCE
            goal = ("met" if held else "MISSED") if inside else ("holds" if held else "named")
            cells = [name, shift, _cell(ours), *map(_cell, others), peer_cell, share]
            lines.append(table_row([*cells, envelope, goal]))
            print(lines[-1], flush=True)
    return lines


NOTES = (
    "Each model is cast on one draw of its data and run on another, shifted. Error: max "
    "|fp64 - tool| / max |fp64| over the outputs fp32 and fp64 hold finite ('non-finite': "
    "inf or nan where they are finite). Envelope: inside when every value "
    "fx16's analyses would keep fp32 for the shifted input (run again with it as the "
    "calibration) is fp32 or rewritten in the cast made on the calibration inputs; outside "
    "names those the cast computes in 16-bit. Goal: inside, fx16 within 3e-3 of fp64 and "
    "finite ('met' / 'MISSED'); outside, 'holds' where it still does, 'named' where the "
    "envelope says it may not."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    lines = measure()
    if args.output is not None:
        write_results(args.output, "Shifted inputs", "python -m benchmarks.shift", NOTES, lines)


if __name__ == "__main__":
    main()
