"""The ``fx16`` command: cast, inspect and compare ``.pt2`` programs without writing Python.

Every failure the user can cause (a missing or corrupt file, an output that would
overwrite the input, an unknown policy, inputs the program does not take) ends with
one line on stderr and exit code 2; an accuracy budget (``--max-rel-error``) that
cannot be met, or a ``compare`` over its threshold, ends with exit code 3. The input
file is never written.

This module only parses: it imports nothing heavy, so ``fx16 --help`` and
``fx16 --version`` answer at once; ``fx16.cli.commands`` (and torch) load when a command
runs.
"""

import argparse
import math
import sys
import time
from pathlib import Path

from fx16.choices import (
    EXPLICIT_FP32_CHOICES,
    INT16_MODES,
    METRIC_PRESETS,
    POLICY_PRESETS,
    PRECISION_NAMES,
    RANGE_FALLBACK_CHOICES,
    ROUTING_CHOICES,
    SCALARS_CHOICES,
)
from fx16.cli.exits import BAD_INPUT, BUDGET_NOT_MET
from fx16.version import installed_version


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad argument told in one line naming the flag (and exit code
    2), not after the command's whole usage block."""

    def error(self, message: str):
        self.exit(BAD_INPUT, f"fx16: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fx16",
        description="Cast torch.export programs to 16-bit.",
        epilog=f"exit codes: 0 done, {BAD_INPUT} bad input (one line on stderr), "
        f"{BUDGET_NOT_MET} an accuracy budget or compare threshold not met",
    )
    parser.add_argument("--version", action="version", version=f"fx16 {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    cast = commands.add_parser("cast", help="cast IN.pt2 and write OUT.pt2")
    cast.add_argument("input", type=Path, metavar="IN.pt2")
    cast.add_argument(
        "-o", "--output", type=Path, metavar="OUT.pt2", help="where to write (not with --dry-run)"
    )
    cast.add_argument("--force", action="store_true", help="allow OUT to be IN")
    _add_cast_options(cast)
    _add_report_option(cast)
    cast.add_argument(
        "--dry-run",
        action="store_true",
        help="cast and summarise without writing a program (-o not needed; a --report "
        "is still written)",
    )

    inspect = commands.add_parser("inspect", help="show what would be cast and why")
    inspect.add_argument("input", type=Path, metavar="IN.pt2")
    _add_cast_options(inspect)
    _add_report_option(inspect)
    inspect.add_argument("--all", action="store_true", help="list 16-bit values too")
    inspect.add_argument(
        "--html",
        type=Path,
        metavar="OUT.html",
        help="also write a self-contained page: layers coloured by precision, with the "
        "reason for every fp32 value",
    )

    compare = commands.add_parser("compare", help="run two programs and compare their outputs")
    compare.add_argument("first", type=Path, metavar="A.pt2")
    compare.add_argument("second", type=Path, metavar="B.pt2")
    compare.add_argument(
        "--inputs",
        type=Path,
        metavar="INPUTS.pt",
        help="a list of input tuples saved with torch.save (default: A's example inputs)",
    )
    compare.add_argument(
        "--max-rel-error",
        type=float,
        metavar="X",
        help=f"exit with {BUDGET_NOT_MET} when an output's relative error (max |A-B| / "
        "max |A|) exceeds X: a check for CI",
    )
    compare.add_argument(
        "--per-node",
        action="store_true",
        help="A is the fp32 program, B its cast: compare every value, not only the outputs, "
        "and name the first that diverges and the ops that amplify error most, with their "
        "module and source line (values aligned by the ids fx16 gives nodes before casting)",
    )
    compare.add_argument(
        "--threshold",
        type=float,
        default=1e-2,
        metavar="T",
        help="with --per-node: the relative error that counts as diverging (default 0.01)",
    )
    compare.add_argument(
        "--json",
        type=Path,
        metavar="OUT.json",
        help="with --per-node: also write every value's error and amplification as JSON",
    )
    _add_import_option(compare)
    _add_timings_option(compare)

    commands.add_parser("demo", help="cast a built-in transformer block and show before/after")
    return parser


def _add_import_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE before loading (it registers the output types the program "
        "returns; the module of a type the archive names is imported without asking)",
    )


def _add_report_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report", type=Path, metavar="REPORT.json", help="write the decision report as JSON"
    )


def _add_timings_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timings",
        action="store_true",
        help="print on stderr where the time goes (start-up, load, reference run, cast, save)",
    )


def _add_cast_options(parser: argparse.ArgumentParser) -> None:
    _add_import_option(parser)
    presets = "; ".join(f"{name}: {meaning}" for name, meaning in POLICY_PRESETS.items())
    parser.add_argument(
        "--policy",
        default="default",
        metavar="NAME",
        help=f"a preset ({presets})",
    )
    parser.add_argument(
        "--explicit-fp32",
        choices=EXPLICIT_FP32_CHOICES,
        default=None,
        help="the model's own fp32 regions: always kept (keep, the policy's default), kept "
        "on evidence (calibrated: fewer fp32 ops, for the Neural Engine) or never (retarget)",
    )
    parser.add_argument(
        "--routing",
        choices=ROUTING_CHOICES,
        default=None,
        help="where routers (an MoE's top-k gate) compute: fp32 (the policy's default) or 16-bit",
    )
    parser.add_argument(
        "--range-fallback",
        choices=RANGE_FALLBACK_CHOICES,
        default=None,
        help="where values fp16's range cannot carry (no power-of-two scale does) compute: "
        "fp32 (the policy's default) or bf16, for targets with both 16-bit dtypes",
    )
    parser.add_argument(
        "--scalars",
        choices=SCALARS_CHOICES,
        default="exact",
        help="which Python numbers of 16-bit ops become 0-d 16-bit constants, so that "
        "ExecuTorch's to_edge casts none on every call: exact (those 16-bit holds; the "
        "default), rounded (also those it rounds to a normal number) or keep (none)",
    )
    parser.add_argument(
        "--stabilize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rewrite patterns 16-bit spoils into forms exact in real arithmetic before "
        "casting (RMSNorm's variance scaled by the row's largest magnitude, log(softmax) as "
        "log_softmax, log(1+x) as log1p, ...), so that they need no fp32 (the policy's "
        "default: on, except under autocast)",
    )
    parser.add_argument(
        "--eps-clamp",
        action="store_true",
        default=None,
        help="raise an eps below the 16-bit smallest normal to it (rsqrt(v + 1e-12)); "
        "changes results where the sum is below it",
    )
    for flag, table, example in (
        ("--module", "modules", "model.layers.0.mlp=fp32"),
        ("--op", "ops", "softmax=fp32"),
        ("--node", "nodes", "linear_3=fp32"),
    ):
        parser.add_argument(
            flag,
            dest=table,
            type=_assignment,
            action="append",
            default=[],
            metavar="NAME=PRECISION",
            help=f"override the policy's precision for a {flag[2:]} (e.g. {example}; "
            f"precisions: {', '.join(PRECISION_NAMES)}); repeatable",
        )
    parser.add_argument(
        "--int16",
        choices=INT16_MODES,
        default="proven",
        help="integers to int16: only where the range provably fits (proven, the "
        "default), also trusting the ranges the calibration inputs show (observed), "
        "everywhere the pattern allows, unchecked (assume_safe), or never (off)",
    )
    parser.add_argument(
        "--input-ranges",
        dest="input_ranges",
        type=_input_range,
        action="append",
        default=[],
        metavar="NAME=LO:HI",
        help="the value range of an integer input (input_ids=0:50256), trusted for "
        "int16 narrowing and for floats made from it; repeatable",
    )
    parser.add_argument(
        "--keep-io-types",
        action="store_true",
        help="keep every user input and output at its original dtype (casts at the boundary)",
    )
    parser.add_argument(
        "--keep-io",
        action="append",
        default=[],
        metavar="NAME",
        help="keep this input (by name) or output (by position or the model's name, such "
        "as logits) at its original dtype; repeatable",
    )
    parser.add_argument(
        "--calibrate",
        type=Path,
        metavar="INPUTS.pt",
        help="a list of input tuples saved with torch.save (default: the program's example inputs)",
    )
    parser.add_argument(
        "--max-rel-error",
        type=float,
        metavar="X",
        help="an accuracy budget: return the fewest ops to fp32 until every output is "
        "within X of fp32 (max |diff| / max |fp32|) on the calibration inputs; exit "
        f"{BUDGET_NOT_MET} when even fp32 cannot meet it",
    )
    parser.add_argument(
        "--target-share",
        type=float,
        metavar="S",
        help="with --max-rel-error: the share of X the calibration error must reach, a "
        "margin for unseen inputs (default: the plain cast's from its spread over the "
        "calibration inputs, leaving each out; a search aims at 1 - 0.5/sqrt(inputs) of X)",
    )
    parser.add_argument(
        "--metric",
        choices=METRIC_PRESETS,
        help="with --max-rel-error: what X measures: rel (default: max |diff| / max |fp32| "
        "of any output), cosine (1 - cosine similarity of an output with fp32's), top1 "
        "(the share of rows whose argmax differs from fp32's)",
    )
    parser.add_argument(
        "--validate",
        type=Path,
        metavar="INPUTS.pt",
        help="with --max-rel-error: inputs the search never sees (a list of input tuples "
        f"saved with torch.save); their error is printed, and the exit code is "
        f"{BUDGET_NOT_MET} when it exceeds X (the program is written all the same)",
    )
    parser.add_argument(
        "--overflow-margin",
        type=float,
        default=2.0,
        metavar="M",
        help="a value counts as overflowing above 65504 / M, since calibration inputs rarely "
        "show the largest values a model will see (default 2; at least 1)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars, no summary")
    _add_timings_option(parser)


def _assignment(text: str) -> tuple[str, str]:
    name, equals, precision = text.rpartition("=")
    if not (equals and name and precision in PRECISION_NAMES):
        raise argparse.ArgumentTypeError(
            f"expected NAME=PRECISION with a precision among {', '.join(PRECISION_NAMES)}, "
            f"got {text!r}"
        )
    return name, precision


def _input_range(text: str) -> tuple[str, tuple[int, int]]:
    name, equals, bounds = text.partition("=")
    low, colon, high = bounds.partition(":")
    try:
        if not (equals and colon and name):
            raise ValueError
        return name, (int(low), int(high))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=LO:HI (integers), got {text!r}") from None


def option_problem(args) -> str | None:
    """What is wrong with the options themselves, checked before anything loads (no
    program, no torch), or None."""
    policy = getattr(args, "policy", None)
    if policy is not None and policy not in POLICY_PRESETS:
        return f"unknown policy {policy!r}; presets: {', '.join(POLICY_PRESETS)}"
    for option in ("max_rel_error", "threshold", "target_share", "overflow_margin"):
        value = getattr(args, option, None)
        flag = f"--{option.replace('_', '-')}"
        if value is not None and not 0 <= value < math.inf:  # NaN too
            return f"{flag} must be a finite number >= 0, got {value:g}"
    if not 0 < (getattr(args, "target_share", None) or 1) <= 1:
        return f"--target-share must be in (0, 1], got {args.target_share:g}"
    if not 1 <= (getattr(args, "overflow_margin", None) or 1):
        return f"--overflow-margin must be at least 1, got {args.overflow_margin:g}"
    if getattr(args, "max_rel_error", None) is None:
        for option in ("target_share", "metric", "validate"):
            if getattr(args, option, None) is not None and args.command != "compare":
                return f"--{option.replace('_', '-')} needs --max-rel-error"
    return None


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    problem = option_problem(args)
    if problem is not None:
        print(f"fx16: error: {problem}", file=sys.stderr)
        return BAD_INPUT
    from fx16.cli import commands  # torch and the passes: only when a command runs

    return commands.run(args, started)


if __name__ == "__main__":
    sys.exit(main())
