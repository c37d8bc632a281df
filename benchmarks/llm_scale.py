"""Casting LLM-sized programs: time, peak memory and GB/s, one process per tool.

    python -m benchmarks.llm_scale [--sizes 0.2B 1.2B] [--tools ...] [--repeats 3]
                                   [--dtype fp32|bf16]

Llama-shaped programs with seeded random weights (no download): "0.2B" (hidden 1024,
12 layers, vocab 32000: 0.78 GiB of fp32 weights), "1.2B" (Llama-3.2-1B's shape:
hidden 2048, 16 layers, vocab 128256, tied embeddings: 4.6 GiB) and "7B" (Llama-2-7B's
shape: hidden 4096, 32 layers, intermediate 11008, vocab 32000: 12.6 GiB in bf16; not
in the default sizes). ``--dtype bf16`` makes the weights directly in bf16 (as LLM
checkpoints ship; never an fp32 copy) and casts them to fp16. Each row runs in a fresh
process, which builds the model, exports it, then measures only the cast:

- ``.half()``: eager ``model.half()`` on the same weights, the floor (each fp32 tensor is
  freed as it is replaced, so its memory is reused for the next fp16 one);
- ``.half(), fp32 kept``: ``[p.half() for p in model.parameters()]``, the floor for any
  cast that leaves the caller's fp32 weights intact: all fp16 memory is fresh, and the
  kernel's page faults for it cost more than the conversion itself;
- ``fx16`` / ``coreai-opt 0.3.0``: ``cast_to_16_bit_precision(ep)`` while the caller
  still holds the model (so its fp32 weights stay alive);
- ``fx16, only reference``: the same after ``del model``, so the program holds the
  only reference to its fp32 weights (what the CLI has after loading a ``.pt2``);
- ``fx16, only reference, target=cpu``: the same with ``target="cpu"``: the model's own
  fp32 regions (each RMSNorm's statistic) kept fp32 as ``.half()`` keeps them, where the
  default (the Neural Engine's) computes each in about 117 16-bit ops instead (2,925
  nodes on the 0.2B's 25 norms, which every later walk reads); ``fx16 cast``'s default;
- ``fx16 cast (CLI)``: the ``fx16 cast IN.pt2 -o OUT.pt2`` command on the saved
  program, load and save included; its memory is counted on top of the loaded program;
- ``one fp32 forward``: the exported program run once on the 8-token example input,
  the least a cast that calibrates by running the program pays beyond converting the
  weights (it streams every fp32 weight once): ``.half()`` plus it bounds an owned
  cast from below, ``.half(), fp32 kept`` plus it a cast whose caller holds the weights.

Peak memory is the process's peak resident set (``VmHWM``, reset just before the
cast) minus what it held before, as a multiple of the fp32 weights' bytes. GB/s is
fp32 weight bytes read per second of cast time. Each row is the median time (and the
largest peak) of ``--repeats`` processes: how fast the kernel hands out fresh pages
varies from one process to the next, and it is most of the cost of any conversion.
"""

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = {
    "0.2B": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2560,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    ),
    "1.2B": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "7B": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    ),
}
DEFAULT_SIZES = ("0.2B", "1.2B")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STAGES = ("build", "export", "calibration", "analysis", "conversion", "cast")
TOOLS = (
    ".half()",
    ".half(), fp32 kept",
    "fx16",
    "fx16, only reference",
    "fx16, only reference, target=cpu",
    "coreai-opt 0.3.0",
    "fx16 cast (CLI)",
    "one fp32 forward",
)


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def build(size: str, dtype: str = "fp32") -> torch.nn.Module:
    """The Llama-shaped model of ``size``, seeded random weights made in ``dtype``
    (the default dtype while it is built: a bf16 model never holds an fp32 copy), eval
    mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=256, use_cache=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        return _Logits(LlamaForCausalLM(config).eval())
    finally:
        torch.set_default_dtype(default)


def export(model: torch.nn.Module) -> torch.export.ExportedProgram:
    return torch.export.export(model, (torch.randint(0, 1000, (1, 8)),))


def weight_bytes(ep: torch.export.ExportedProgram) -> int:
    unique = {id(t): t for t in ep.state_dict.values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS


def _measure(cast) -> dict:
    gc.collect()
    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    cast()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_extra": _status("VmHWM") - before}


def worker(tool: str, size: str, pt2: str, dtype: str = "fp32") -> dict:
    """Measure one tool on one size in this process; the figures as a dict."""
    if tool == "stages":
        return stages(size, dtype)
    if tool == "fx16 cast (CLI)":
        from fx16.cli import main

        ep = torch.export.load(pt2)
        weights = weight_bytes(ep)
        del ep
        with tempfile.TemporaryDirectory() as directory:
            out = str(Path(directory) / "out.pt2")
            figures = _measure(lambda: main(["cast", pt2, "-o", out, "--quiet"]))
        figures["peak_extra"] -= weights  # the loaded program itself
        return {**figures, "weights": weights}
    model = build(size, dtype)
    ep = export(model)
    weights = weight_bytes(ep)
    if tool == ".half()":
        del ep
        return {**_measure(model.half), "weights": weights}
    if tool == "one fp32 forward":
        module, example = ep.module(), torch.randint(0, 1000, (1, 8))
        with torch.no_grad():
            figures = _measure(lambda: module(example))
        return {**figures, "weights": weights}
    if tool == ".half(), fp32 kept":
        copies = []
        figures = _measure(lambda: copies.extend(p.half() for p in model.parameters()))
        return {**figures, "weights": weights}
    if tool.startswith("fx16"):
        from fx16 import cast_to_16_bit_precision
    else:
        from coreai_opt.casting import cast_to_16_bit_precision
    if tool.startswith("fx16, only reference"):
        del model
    options = {"target": "cpu"} if tool.endswith("target=cpu") else {}
    return {**_measure(lambda: cast_to_16_bit_precision(ep, **options)), "weights": weights}


def stages(size: str, dtype: str) -> dict:
    """One process, as a user casts a checkpoint: build, export, then
    ``cast_to_16_bit_precision`` with only the program holding the weights; the seconds
    of each stage (the cast's: calibration, the analyses and rewrites, the conversion of
    the weights) and the process's peak resident set."""
    from fx16 import cast_to_16_bit_precision
    from fx16.analysis.calibration import CalibrationAnalysis
    from fx16.program import Program

    seconds: dict[str, float] = {}

    def timed(owner, name: str, stage: str) -> None:
        method = getattr(owner, name)

        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - start

        setattr(owner, name, run)

    timed(CalibrationAnalysis, "call", "calibration")
    timed(Program, "commit_state", "conversion")
    start = time.perf_counter()
    model = build(size, dtype)
    seconds["build"] = time.perf_counter() - start
    start = time.perf_counter()
    ep = export(model)
    seconds["export"] = time.perf_counter() - start
    del model
    gc.collect()
    weights = weight_bytes(ep)
    start = time.perf_counter()
    cast_to_16_bit_precision(ep)
    seconds["cast"] = time.perf_counter() - start
    seconds["analysis"] = seconds["cast"] - seconds["calibration"] - seconds["conversion"]
    return {**seconds, "weights": weights, "peak_rss": _status("VmHWM")}


def _save_program(size: str, dtype: str, path: Path) -> None:
    torch.export.save(export(build(size, dtype)), path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=list(DEFAULT_SIZES), choices=list(SIZES))
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="the weights' dtype")
    parser.add_argument("--tools", nargs="*", default=list(TOOLS), choices=list(TOOLS))
    parser.add_argument("--repeats", type=int, default=3, help="processes per row")
    parser.add_argument(
        "--stages",
        action="store_true",
        help="one process per size: the seconds of each stage and the peak resident set",
    )
    parser.add_argument(
        "--worker", nargs=4, metavar=("TOOL", "SIZE", "PT2", "DTYPE"), help="internal"
    )
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    if args.stages:
        _print_stages(args.sizes, args.dtype)
        return
    header = "| tool | time | vs .half() | peak extra memory | GB/s |"
    print(f"| program | {args.dtype} weights {header}")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as directory:
            pt2 = Path(directory) / f"llama-{size}.pt2"
            if "fx16 cast (CLI)" in args.tools:
                _save_program(size, args.dtype, pt2)
            half_seconds = None
            for tool in args.tools:
                runs = [_run_worker(tool, size, pt2, args.dtype) for _ in range(args.repeats)]
                failed = next((run for run in runs if isinstance(run, str)), None)
                if failed is not None:
                    print(f"| {size} | | {tool} | failed: {failed} | | | |", flush=True)
                    continue
                seconds = statistics.median(run["seconds"] for run in runs)
                peak = max(run["peak_extra"] for run in runs)
                weights = runs[0]["weights"]
                if tool == ".half()":
                    half_seconds = seconds
                ratio = f"{seconds / half_seconds:.1f}x" if half_seconds else ""
                print(
                    f"| {size} | {weights / 2**30:.2f} GiB | {tool} | {seconds:.2f} s "
                    f"| {ratio} | {peak / weights:.2f}x | {weights / seconds / 1e9:.1f} |",
                    flush=True,
                )


def _print_stages(sizes, dtype: str) -> None:
    print(
        f"| program | {dtype} weights | build | export | calibration | analysis | conversion "
        "| cast | .half() | cast vs .half() | peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        found = _run_worker("stages", size, Path("-"), dtype)
        half = _run_worker(".half()", size, Path("-"), dtype)
        if isinstance(found, str):
            print(f"| {size} | | failed: {found} |", flush=True)
            continue
        half_seconds = half["seconds"] if isinstance(half, dict) else float("nan")
        cells = [f"{found[stage]:.1f} s" for stage in STAGES]
        print(
            f"| {size} | {found['weights'] / 2**30:.2f} GiB | {' | '.join(cells)} "
            f"| {half_seconds:.1f} s | {found['cast'] / half_seconds:.1f}x "
            f"| {found['peak_rss'] / 2**30:.1f} GiB |",
            flush=True,
        )


def _run_worker(tool: str, size: str, pt2: Path, dtype: str) -> dict | str:
    """One measurement in a fresh process: its figures, or the last line of its error."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.llm_scale", "--worker", tool, size, str(pt2), dtype],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
