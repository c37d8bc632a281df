"""Precision losses outside the patterns fx16 first knew: underflow before a singular op,
cancellation inside fused normalizations, and facts that must cross higher-order ops.

    python -m benchmarks.safety_traps [--before DIR]

Each case is calibrated on its example input (torch.export's recorded one) and judged
on an unseen input that differs: sharper logits, rows of zeros, data further from zero.
Error: max |fp64 - cast| / max |fp64| over the finite elements, with the count of
outputs that are inf or nan where fp64's are not. Columns: fx16 now, eager
``.half()``, and with ``--before DIR`` the fx16 package found in DIR (an earlier
checkout), run on the same cases in a subprocess. The last column: the rules fx16's
report gives for what it kept in fp32 or clamped.

The rotary LLMs decode at positions 1500-2040 after one prefill (``decode_outputs``);
their error is against the eager fp32 module transformers exports for devices.
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

import fx16
from benchmarks.precision_zoo import (
    TABULAR_MEANS,
    TABULAR_SPREADS,
    Entropy,
    KLDivergence,
    NegativeLogLikelihood,
    Normalized,
    NormOfOffsetData,
    RMSNormEps,
    SpreadOfOffsetData,
    Standardized,
    TabularBatchNorm,
    decode_outputs,
    offset_features,
    rope_llm,
)
from fx16.program import Program


def _draw(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _zero_rows(seed: int) -> torch.Tensor:
    x = _draw(seed, 16, 32)
    x[:3] = 0
    return x


def cases():
    """(name, build, example args, unseen args)."""
    targets = [
        torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    ]
    yield "entropy of a sharp softmax", Entropy, (_draw(1, 16, 32),), (_draw(2, 16, 32) * 1.5,)
    yield "KL of two sharp softmaxes", KLDivergence, (_draw(1, 16, 32),), (_draw(2, 16, 32) * 1.5,)
    yield (
        "NLL as -log(softmax)[target]",
        NegativeLogLikelihood,
        (_draw(1, 16, 32), targets[0]),
        (_draw(2, 16, 32) * 1.5, targets[1]),
    )
    yield "F.normalize, eps 1e-12", Normalized, (_draw(1, 16, 32),), (_zero_rows(2),)
    yield (
        "x / (norm + 1e-12)",
        lambda: Normalized(by_hand=True),
        (_draw(1, 16, 32),),
        (_zero_rows(2),),
    )
    yield "RMSNorm, eps 1e-12", RMSNormEps, (_draw(1, 16, 32),), (_zero_rows(2),)

    def tabular(seed, scale=1.0):
        return offset_features(64, TABULAR_MEANS * scale, TABULAR_SPREADS, seed)

    yield "BatchNorm1d on raw features", TabularBatchNorm, (tabular(1),), (tabular(2, 1.2),)
    yield "standardized by buffers", Standardized, (tabular(1),), (tabular(2, 1.1),)
    for kind, width in (("layer", 16), ("group", 64), ("instance", 64)):
        readings = lambda seed, scale=1.0, w=width: offset_features(  # noqa: E731
            64, torch.full((w,), 3000.0 * scale), torch.full((w,), 2.0), seed
        )
        yield (
            f"{kind} norm of readings around 3000",
            lambda k=kind: NormOfOffsetData(k),
            (readings(1),),
            (readings(2, 1.5),),
        )
    spread = lambda seed, scale=1.0: offset_features(  # noqa: E731
        64, torch.full((64,), 100.0 * scale), torch.ones(64), seed
    )
    yield "x.std() of data 100 +- 1", SpreadOfOffsetData, (spread(1),), (spread(2, 1.2),)
    yield (
        "sqrt(E[x^2] - E[x]^2) of data 100 +- 1",
        lambda: SpreadOfOffsetData(by_hand=True),
        (spread(1),),
        (spread(2, 1.2),),
    )


def fp64_outputs(model, args):
    """What ``model`` computes in fp64 on ``args`` (floats widened)."""
    with torch.no_grad():
        return copy.deepcopy(model).double()(
            *[a.double() if a.is_floating_point() else a for a in args]
        )


def judge(want: torch.Tensor, got: torch.Tensor) -> tuple[float, int]:
    """(max |want - got| / max |want| over the finite elements, how many elements are inf
    or nan in ``got`` where ``want``'s are finite)."""
    want, got = want.double(), got.double()
    bad = int((~torch.isfinite(got) & torch.isfinite(want)).sum())
    finite = torch.isfinite(got) & torch.isfinite(want)
    error = (
        float((want - got)[finite].abs().max() / want[finite].abs().max()) if finite.any() else 1.0
    )
    return error, bad


def _rules(ep) -> str:
    report = fx16.report.report_of(ep)
    kept = Counter(
        row.rule
        for row in report.rows
        if row.kind == "float" and (not row.narrowed or row.rule == "scalar_clamped")
    )
    return ", ".join(f"{rule} x{count}" for rule, count in kept.most_common()) or "-"


def fx16_results() -> dict:
    """case -> (error, non-finite count, rules) of fx16's default cast."""
    results = {}
    for name, build, example, unseen in cases():
        torch.manual_seed(0)
        model = build().eval()
        ep = fx16.cast_fp32_to_fp16(torch.export.export(model, example))
        with torch.no_grad():
            got = ep.module()(*Program(ep).adapt_call(unseen)[0])
        results[name] = (*judge(fp64_outputs(model, unseen), got), _rules(ep))
    for name in ("qwen3", "gemma3", "llama"):
        for strict in (False, True):
            results[
                f"{name} RoPE, static cache 2048, {'strict' if strict else 'default'} export"
            ] = _rope(name, strict)
    return results


def _rope(name: str, strict: bool) -> tuple[float, int, str]:
    step = rope_llm(name)
    example = {"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([0])}
    cast = fx16.cast_fp32_to_fp16(torch.export.export(step, (), example, strict=strict))
    judged = [judge(want, got) for want, got in decode_outputs(step, cast)]
    return max(e for e, _ in judged), sum(b for _, b in judged), _rules(cast)


def half_results() -> dict:
    results = {}
    for name, build, _, unseen in cases():
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad():
            got = copy.deepcopy(model).half()(
                *[a.half() if a.is_floating_point() else a for a in unseen]
            )
        results[name] = judge(fp64_outputs(model, unseen), got)
    return results


def before_results(directory: Path) -> dict:
    """fx16_results() with the fx16 package of ``directory``, in a subprocess."""
    with tempfile.TemporaryDirectory() as shadow:
        os.symlink(directory.resolve() / "fx16", Path(shadow) / "fx16")
        root = Path(__file__).resolve().parent.parent
        environment = {**os.environ, "PYTHONPATH": f"{shadow}{os.pathsep}{root}"}
        done = subprocess.run(  # from the shadow folder: python -m puts it first on the path
            [sys.executable, "-m", "benchmarks.safety_traps", "--json"],
            cwd=shadow,
            env=environment,
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(done.stdout.splitlines()[-1])


def _cell(result) -> str:
    if result is None:
        return "-"
    error, bad = result[0], result[1]
    return f"{error:.2e}" + (f", {bad} non-finite" if bad else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout whose fx16 to compare")
    parser.add_argument("--json", action="store_true", help="print fx16's results as JSON")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    now = fx16_results()
    if options.json:
        print(json.dumps(now))
        return
    before = before_results(options.before) if options.before else {}
    half = half_results()
    print("| case | fx16 before | fx16 now | .half() | what fx16 kept in fp32 or clamped |")
    print("|---|---|---|---|---|")
    for name, result in now.items():
        cells = [_cell(before.get(name)), _cell(result), _cell(half.get(name)), result[2]]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
