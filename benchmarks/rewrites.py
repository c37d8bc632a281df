"""Each default rewrite and retarget of fx16's cast against the plain form, per input kind
and CPU kernel path.

    python -m benchmarks.rewrites [--output benchmarks/REWRITES.md] [--capabilities ...]

fx16's default cast rewrites what 16-bit spoils (the stable rewrites of
``fx16.passes.stabilize``) and carries values beyond fp16's range at power-of-two scales
(scale domains). Each is measured against the same cast without it, one at a time: a
stable rewrite by the pipeline built without that rule, scale domains by
``scale_range=False``; and the option that retargets the model's own fp32 regions to
16-bit where nothing shows they need fp32 (``explicit_fp32="calibrated"``, the default
before this benchmark showed its cost) against the default, which keeps them as
``.half()`` does. A variant whose program is the default's (the change finds nothing)
is left out. Beside each, eager ``.half()``: the plain form.

Models: the shift benchmark's float-input models on each of its input shifts, and
token models of the zoo (BERT, GPT-2 with 4 layers, Llama, a T5 v1.1 encoder inside
fp16's range, a BERT with a written-out tanh GELU) on fresh token ids. Each error is
the mean over eight draws of max |fp64 - program| / max |fp64| (``benchmarks.shift``'s
judge: where fp32 and fp64 are finite; a non-finite output counts 1). The rows run
once per ATen CPU kernel path (``ATEN_CPU_CAPABILITY``, each in a child process, as
the variable is read when torch loads): 16-bit kernels round differently on each.

The default is worse on a row where its mean error is above 1.1x both the variant's and
``.half()``'s, and above the variant's on every draw (better: the variant's mean above
1.1x the default's, and above it on every draw); the table lists every row where the two
differ by more than 10%, and a summary counts rows and verdicts per change and path.
"""

import argparse
import contextlib
import copy
import json
import os
import signal
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

DRAWS = tuple(range(2, 10))  # the seeds of the inputs each row is measured on
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
    """(the change from the default, a context to cast in, cast keywords)."""
    for rule in stabilize.standard_rules(torch.float16):
        yield f"without {rule.name}", _without_rule(rule.name), {}
    policy = PrecisionPolicy(scale_range=False)
    yield "without scale domains", contextlib.nullcontext(), {"policy": policy}
    yield 'explicit_fp32="calibrated"', contextlib.nullcontext(), {"explicit_fp32": "calibrated"}


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
        for change, context, keywords in variants():
            cast = _cast(ep, context, keywords)
            if cast.graph_module.code != default.graph_module.code:
                others.append((change, cast))
        half = copy.deepcopy(model).half()
        for shift_name, apply in shifts.items():
            inputs = [apply(draw(seed)) for seed in DRAWS]
            errors = [_error(default, model, x) for x in inputs]
            plain = [_error_of(half(_half(x)), model, x) for x in inputs]
            for change, cast in others:
                variant = [_error(cast, model, x) for x in inputs]
                rows.append(
                    {
                        "model": name,
                        "shift": shift_name,
                        "change": change,
                        "default": errors,
                        "variant": variant,
                        "half": plain,
                    }
                )
                print(name, shift_name, change, _mean(plain), _mean(errors), _mean(variant))
    return rows


def _mean(values) -> float:
    return sum(values) / len(values)


def worse(row: dict) -> bool:
    """The default loses to the variant and to the plain form."""
    default = _mean(row["default"])
    return (
        default > LOSS * _mean(row["variant"])
        and default > LOSS * _mean(row["half"])
        and all(d > v for d, v in zip(row["default"], row["variant"]))
    )


def better(row: dict) -> bool:
    return _mean(row["variant"]) > LOSS * _mean(row["default"]) and all(
        v > d for d, v in zip(row["default"], row["variant"])
    )


def _on_path(capability: str) -> list[dict] | None:
    """``measure_here`` in a child process with ``ATEN_CPU_CAPABILITY=capability``; None
    where this CPU lacks the path (torch takes the setting as given, and the first
    kernel that needs the missing instructions stops the child with SIGILL)."""
    environment = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    command = [sys.executable, "-m", "benchmarks.rewrites", "--here"]
    done = subprocess.run(command, env=environment, capture_output=True, text=True)
    if done.returncode == -signal.SIGILL:
        return None
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    return json.loads(done.stdout.splitlines()[-1])


def tables(by_path: dict[str, list[dict]]) -> list[str]:
    lines = [
        "## Summary",
        "",
        table_row(["change", *(f"{path}: rows / default better / worse" for path in by_path)]),
        "|---|" + "---|" * len(by_path),
    ]
    changes = dict.fromkeys(row["change"] for rows in by_path.values() for row in rows)
    for change in changes:
        cells = []
        for rows in by_path.values():
            mine = [row for row in rows if row["change"] == change]
            cells.append(f"{len(mine)} / {sum(map(better, mine))} / {sum(map(worse, mine))}")
        lines.append(table_row([change, *cells]))
    for path, rows in by_path.items():
        lines += [
            "",
            f"## ATEN_CPU_CAPABILITY={path}: rows where the two differ by more than 10%",
            "",
            table_row(["change", "model", "input", "default", "changed", ".half()", "default"]),
            "|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            default, variant = _mean(row["default"]), _mean(row["variant"])
            if max(default, variant) <= LOSS * min(default, variant):
                continue
            verdict = "worse" if worse(row) else "better" if better(row) else "mixed"
            errors = (f"{value:.2e}" for value in (default, variant, _mean(row["half"])))
            lines.append(table_row([row["change"], row["model"], row["shift"], *errors, verdict]))
    return lines


NOTES = (
    "Each default rewrite against the same cast without it, and the retarget option "
    '(`explicit_fp32="calibrated"`) against the default, per input kind and CPU kernel '
    "path (`ATEN_CPU_CAPABILITY`), with eager `.half()` (the plain form) beside. Errors: "
    "the mean over eight draws of max |fp64 - program| / max |fp64|. The last column "
    "judges the default: 'worse' where its mean is above 1.1x the changed cast's and "
    "`.half()`'s and above the changed cast's on every draw; 'better' where the changed "
    "cast's mean is above 1.1x the default's and above it on every draw; 'mixed' "
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
    measured = {capability: _on_path(capability) for capability in arguments.capabilities}
    by_path = {path: rows for path, rows in measured.items() if rows is not None}
    missing = [path for path, rows in measured.items() if rows is None]
    notes = NOTES + (
        f" Not measured, this CPU lacks the path: {', '.join(missing)}." if missing else ""
    )
    write_results(
        arguments.output,
        "Rewrites and retargets against the plain form",
        "python -m benchmarks.rewrites",
        notes,
        tables(by_path),
    )


if __name__ == "__main__":
    main()
