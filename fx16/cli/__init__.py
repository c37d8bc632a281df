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

from fx16.choices import POLICY_PRESETS
from fx16.cli.exits import BAD_INPUT, BUDGET_NOT_MET
from fx16.cli.options import (
    add_cast_options,
    add_import_option,
    add_report_option,
    add_timings_option,
)
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
    add_cast_options(cast)
    add_report_option(cast)
    cast.add_argument(
        "--dry-run",
        action="store_true",
        help="cast and summarise without writing a program (-o not needed; a --report "
        "is still written)",
    )

    inspect = commands.add_parser("inspect", help="show what would be cast and why")
    inspect.add_argument("input", type=Path, metavar="IN.pt2")
    add_cast_options(inspect)
    add_report_option(inspect)
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
    add_import_option(compare)
    add_timings_option(compare)

    commands.add_parser("demo", help="cast a built-in transformer block and show before/after")
    return parser


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
