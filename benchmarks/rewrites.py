"""Each default rewrite and retarget of fx16's cast against the plain form, per input kind
and CPU kernel path.

    python -m benchmarks.rewrites [--output benchmarks/REWRITES.md] [--capabilities ...]

fx16's default cast rewrites what 16-bit spoils (the stable rewrites of
``fx16.passes.stabilize``), carries values beyond fp16's range at power-of-two scales
(scale domains) and retargets the model's own fp32 regions to 16-bit where nothing shows
they need fp32 (``explicit_fp32="calibrated"``). Each is measured against the same cast
without it, one at a time: a stable rewrite by the pipeline built without that rule,
scale domains by ``scale_range=False``, the retarget by ``explicit_fp32="keep"`` (the
model's regions as ``.half()`` keeps them). A variant whose program is the default's
(the rewrite finds nothing) is left out.

Models: the shift benchmark's float-input models on each of its input shifts, and
token models of the zoo (BERT, GPT-2 with 4 layers, Llama, a T5 v1.1 encoder inside
fp16's range, a BERT with a written-out tanh GELU) on fresh token ids. Each error is
the mean over three draws of max |fp64 - program| / max |fp64| (``benchmarks.shift``'s
judge: where fp32 and fp64 are finite; a non-finite output counts 1). The rows run
once per ATen CPU kernel path (``ATEN_CPU_CAPABILITY``, each in a child process, as
the variable is read when torch loads): 16-bit kernels round differently on each.

A rewrite loses on a row where the default's mean error is above 1.1x that of the
cast without it and above it on every draw; the table lists every row where the two
differ by more than 10%, and a summary counts rows, wins and losses per rewrite and path.
"""

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from unittest import mock

import torch

import fx16
from benchmarks import shift, zoo
from benchmarks.markdown import table_row, write_results
from benchmarks.safety_traps import fp64_outputs
from fx16.passes import stabilize
from fx16.policy import PrecisionPolicy
from fx16.program import Program

DRAWS = (2, 3, 4)  # the seeds of the inputs each row is measured on
CAPABILITIES = ("default", "avx2", "avx512")
LOSS = 1.1  # a rewrite loses where the default's mean error passes this multiple


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def token_models():
    """(name, build, draw(seed) -> the token ids)."""
    yield "BERT", lambda: zoo.bert(2), _ids
    yield "GPT-2, 4 layers", lambda: zoo.gpt2(4), _ids
    yield "Llama", lambda: zoo.llama(2), _ids
    yield "T5 v1.1 encoder (in range)", lambda: zoo.massive_t5_encoder(2e3), _ids
    yield "BERT, tanh GELU written out", lambda: zoo.bert_gelu_tanh(2), _ids


def cases():
    """(model name, build, draw, {shift name: shift}) for every measured model."""
    for name, build, draw in shift.models():
        yield name, build, draw, shift.SHIFTS
    for name, build, draw in token_models():
        yield name, build, draw, {"fresh ids": lambda ids: ids}


@contextlib.contextmanager
def _without_rule(name: str):
    """The pipeline built while this is open leaves out the stable rewrite ``name``."""
    standard = stabilize.standard_rules

    def rules(*args, **kwargs):
        return [rule for rule in standard(*args, **kwargs) if rule.name != name]

    with mock.patch.object(stabilize, "standard_rules", rules):
        yield


def variants():
    """(what the variant leaves out, a context to cast in, cast keywords)."""
    for rule in stabilize.standard_rules(torch.float16):
        yield rule.name, _without_rule(rule.name), {}
    yield "scale domains", contextlib.nullcontext(), {"policy": PrecisionPolicy(scale_range=False)}
    yield "retarget of the model's fp32", contextlib.nullcontext(), {"explicit_fp32": "keep"}


def _cast(ep, context, keywords):
    with context:
        return fx16.cast_fp32_to_fp16(copy.deepcopy(ep), **keywords)


def _half(x: torch.Tensor) -> torch.Tensor:
    return x.half() if x.is_floating_point() else x


def _error(cast, model, x) -> float:
    with torch.no_grad():
        return _error_of(cast.module()(*Program(cast).adapt_call((x,))[0]), model, x)


def _error_of(got: torch.Tensor, model, x) -> float:
    want = fp64_outputs(model, (x,))
    with torch.no_grad():
        fp32 = model(x)
    error, bad = shift.judge(want, fp32, got)
    return 1.0 if bad else error


def measure_here() -> list[dict]:
    """Every row on this process's kernel path: model, shift, the variant, the errors."""
    rows = []
    for name, build, draw, shifts in cases():
        torch.manual_seed(0)
        model = build().eval()
        ep = torch.export.export(model, (draw(1),))
        default = _cast(ep, contextlib.nullcontext(), {})
        others = []
        for left_out, context, keywords in variants():
            cast = _cast(ep, context, keywords)
            if cast.graph_module.code != default.graph_module.code:
                others.append((left_out, cast))
        half = copy.deepcopy(model).half()
        for shift_name, apply in shifts.items():
            inputs = [apply(draw(seed)) for seed in DRAWS]
            errors = [_error(default, model, x) for x in inputs]
            plain = [_error_of(half(_half(x)), model, x) for x in inputs]
            for left_out, cast in others:
                without = [_error(cast, model, x) for x in inputs]
                rows.append(
                    {
                        "model": name,
                        "shift": shift_name,
                        "rewrite": left_out,
                        "default": errors,
                        "without": without,
                        "half": plain,
                    }
                )
                print(name, shift_name, left_out, _mean(plain), _mean(errors), _mean(without))
    return rows


def _mean(values) -> float:
    return sum(values) / len(values)


def loses(row: dict) -> bool:
    return _mean(row["default"]) > LOSS * _mean(row["without"]) and all(
        d > w for d, w in zip(row["default"], row["without"])
    )


def wins(row: dict) -> bool:
    return _mean(row["without"]) > LOSS * _mean(row["default"]) and all(
        w > d for d, w in zip(row["default"], row["without"])
    )


def _on_path(capability: str) -> list[dict]:
    """``measure_here`` in a child process with ``ATEN_CPU_CAPABILITY=capability``."""
    environment = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    command = [sys.executable, "-m", "benchmarks.rewrites", "--here"]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def tables(by_path: dict[str, list[dict]]) -> list[str]:
    lines = [
        "## Summary",
        "",
        table_row(["rewrite", *(f"{path}: rows / better / worse" for path in by_path)]),
        "|---|" + "---|" * len(by_path),
    ]
    rewrites = dict.fromkeys(row["rewrite"] for rows in by_path.values() for row in rows)
    for rewrite in rewrites:
        cells = []
        for rows in by_path.values():
            mine = [row for row in rows if row["rewrite"] == rewrite]
            better, worse = sum(map(wins, mine)), sum(map(loses, mine))
            cells.append(f"{len(mine)} / {better} / {worse}")
        lines.append(table_row([rewrite, *cells]))
    for path, rows in by_path.items():
        lines += [
            "",
            f"## ATEN_CPU_CAPABILITY={path}: rows where the two differ by more than 10%",
            "",
            table_row(["rewrite", "model", "input", "default", "without it", "verdict"]),
            "|---|---|---|---|---|---|",
        ]
        for row in rows:
            default, without = _mean(row["default"]), _mean(row["without"])
            if max(default, without) <= LOSS * min(default, without):
                continue
            verdict = "worse" if loses(row) else "better" if wins(row) else "mixed over draws"
            cells = [row["rewrite"], row["model"], row["shift"], f"{default:.2e}", f"{without:.2e}"]
            lines.append(table_row([*cells, verdict]))
    return lines


NOTES = (
    "Each default rewrite and retarget against the same cast without it, per input kind "
    "and CPU kernel path (`ATEN_CPU_CAPABILITY`). Errors: the mean over three draws of "
    "max |fp64 - program| / max |fp64|. 'worse': the default's mean above 1.1x the "
    "other's and above it on every draw; 'better' the other way; 'mixed over draws' "
    "otherwise. Rows within 10% are counted in the summary only."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("REWRITES.md"))
    parser.add_argument("--capabilities", nargs="+", default=list(CAPABILITIES))
    parser.add_argument("--here", action="store_true", help="measure on this process's path")
    arguments = parser.parse_args()
    warnings.filterwarnings("ignore")
    if arguments.here:
        with contextlib.redirect_stdout(sys.stderr):
            rows = measure_here()
        print(json.dumps(rows))
        return
    by_path = {capability: _on_path(capability) for capability in arguments.capabilities}
    write_results(
        arguments.output,
        "Rewrites against the plain form",
        "python -m benchmarks.rewrites",
        NOTES,
        tables(by_path),
    )


if __name__ == "__main__":
    main()
