"""Casting compressed programs: fx16 next to coreai-opt, compression by model.

    python -m benchmarks.compressed [--output benchmarks/COMPRESSED.md]
        [--compressions NAME ...] [--models NAME ...] [--exports default decomposed]

Each program comes from ``benchmarks.compression``: a seeded model compressed by
coreai-opt (quantization, palettization, pruning, finalized for Core AI) or torchao,
exported as is or decomposed with ``coreai_torch.get_decomp_table()``, then cast by
each tool. Columns: whether the cast program runs on 16-bit inputs, its SNR against
the uncast compressed program (dB), the share of float compute ops that produce
16-bit values, whether every int8/uint8 tensor of the state is byte-identical,
whether coreai_torch converts it (and the uncast program), and the time of the cast.
"""

import argparse
import copy
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import fx16
from benchmarks.compression import (
    COMPRESSIONS,
    MODELS,
    compressed_program,
    converts,
    quantized_bytes,
    share_16bit,
    snr_db,
)
from benchmarks.markdown import table_row, write_results


def tools() -> dict:
    """name -> function(ep) casting in place."""
    found = {"fx16": fx16.cast_to_16_bit_precision}
    try:
        from coreai_opt.casting import cast_to_16_bit_precision
    except ImportError:
        return found
    found["coreai-opt 0.3.0"] = cast_to_16_bit_precision
    return found


@dataclass(frozen=True)
class Outcome:
    """What one tool's cast of one compressed program gives."""

    error: str  # "" when the cast and the run succeeded
    snr_db: float = float("nan")
    share_16bit: float = float("nan")
    quantized_untouched: bool = False
    converts: str = ""
    seconds: float = float("nan")

    @property
    def correct(self) -> bool:
        return not self.error and self.snr_db > 30 and self.quantized_untouched


def cast_and_assess(ep, example, cast, convert: bool = True) -> Outcome:
    """Cast a copy of ``ep`` with ``cast`` and measure it against ``ep``."""
    reference = ep.module()(example)
    candidate = copy.deepcopy(ep)
    before = quantized_bytes(candidate)
    try:
        start = time.perf_counter()
        cast(candidate)
        seconds = time.perf_counter() - start
        output = candidate.module()(example.half())
    except Exception as error:  # a failure is a result
        return Outcome(error=f"{type(error).__name__}: {str(error).splitlines()[0][:80]}")
    return Outcome(
        error="",
        snr_db=snr_db(reference, output.float()),
        share_16bit=share_16bit(candidate),
        quantized_untouched=quantized_bytes(candidate) == before,
        converts=converts(candidate) if convert else "",
        seconds=seconds,
    )


HEADER = [
    "compression",
    "model",
    "export",
    "tool",
    "runs",
    "SNR dB",
    "16-bit ops",
    "int8 untouched",
    "converts (uncast)",
    "cast time",
]


def _cells(outcome: Outcome, uncast_converts: str) -> list[str]:
    if outcome.error:
        return [f"no: {outcome.error}", "", "", "", "", ""]
    return [
        "yes",
        f"{outcome.snr_db:.1f}",
        f"{outcome.share_16bit:.0%}",
        "yes" if outcome.quantized_untouched else "NO",
        f"{outcome.converts} ({uncast_converts})",
        f"{outcome.seconds * 1000:.0f} ms",
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("COMPRESSED.md"))
    parser.add_argument("--compressions", nargs="*", default=list(COMPRESSIONS))
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--exports", nargs="*", default=["default", "decomposed"])
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    lines = [table_row(HEADER), "|" + "---|" * len(HEADER)]
    correct = {tool: 0 for tool in tools()}
    cases = 0
    for compression in options.compressions:
        for model in options.models:
            for export in options.exports:
                try:
                    ep, example = compressed_program(compression, model, export == "decomposed")
                except Exception as error:  # some compressions do not export everywhere
                    cells = [compression, model, export, "-", f"does not export: {error!s:.60}"]
                    lines.append(table_row(cells + [""] * (len(HEADER) - len(cells))))
                    continue
                cases += 1
                uncast_converts = converts(ep)
                for tool, cast in tools().items():
                    outcome = cast_and_assess(ep, example, cast)
                    correct[tool] += outcome.correct
                    cells = [compression, model, export, tool]
                    lines.append(table_row(cells + _cells(outcome, uncast_converts)))
                    print(lines[-1], flush=True)
    summary = ", ".join(f"{tool} {count} of {cases}" for tool, count in correct.items())
    print(f"correct (runs, SNR > 30 dB, int8 untouched): {summary}")
    notes = (
        "Programs from `benchmarks/compression.py` (coreai-opt 0.3.0 compressions finalized "
        "for Core AI; torchao 0.18), cast with `cast_to_16_bit_precision` by each tool. "
        "SNR against the uncast compressed program on its example input; the cast program "
        "gets the input in fp16. 16-bit ops: float compute ops producing fp16/bf16. "
        "Converts: coreai_torch 0.4.3 `TorchConverter`, the uncast program's result in "
        f"brackets. Correct (runs, SNR > 30 dB, int8 untouched): {summary}."
    )
    write_results(
        options.output, "Compressed programs", "python -m benchmarks.compressed", notes, lines
    )


if __name__ == "__main__":
    main()
