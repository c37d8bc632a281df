"""The ``fx16`` command: cast, inspect and compare ``.pt2`` programs without writing Python.

Every failure the user can cause (a missing or corrupt file, an output that would
overwrite the input, an unknown policy, inputs the program does not take) ends with
one line on stderr and exit code 2; an accuracy budget (``--max-rel-error``) that
cannot be met ends with one line and exit code 3. The input file is never written.
"""

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

from fx16.analysis.calibration import calibration_calls
from fx16.archive import import_modules, load_program
from fx16.casting import cast_to_16_bit_precision
from fx16.demo import run_demo
from fx16.errors import AccuracyBudgetError, Fx16Error, one_line
from fx16.narrowing import INT16_MODES
from fx16.nodes import dtype_name
from fx16.pipelines import resolve_policy
from fx16.policy import EXPLICIT_FP32_CHOICES
from fx16.program import Program
from fx16.report import format_rows, report_of
from fx16.report_html import report_html
from fx16.stats import relative_error

# Above this many values, inspect opens with a summary per layer.
LAYER_SUMMARY_ROWS = 60

# Exit codes besides 0.
BAD_INPUT = 2
BUDGET_NOT_MET = 3


class CommandError(Exception):
    """A problem with what the user asked for, reported as one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fx16",
        description="Cast torch.export programs to 16-bit.",
        epilog=f"exit codes: 0 done, {BAD_INPUT} bad input (one line on stderr), "
        f"{BUDGET_NOT_MET} the accuracy budget cannot be met",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    cast = commands.add_parser("cast", help="cast IN.pt2 and write OUT.pt2")
    cast.add_argument("input", type=Path, metavar="IN.pt2")
    cast.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.pt2")
    cast.add_argument("--force", action="store_true", help="allow OUT to be IN")
    _add_cast_options(cast)
    cast.add_argument(
        "--report", type=Path, metavar="REPORT.json", help="write the decision report"
    )
    cast.add_argument("--dry-run", action="store_true", help="cast and summarise, write nothing")

    inspect = commands.add_parser("inspect", help="show what would be cast and why")
    inspect.add_argument("input", type=Path, metavar="IN.pt2")
    _add_cast_options(inspect)
    inspect.add_argument("--all", action="store_true", help="list 16-bit values too")
    inspect.add_argument(
        "--html",
        type=Path,
        metavar="OUT.html",
        help="also write a self-contained page: layers coloured by precision, reasons on hover",
    )

    compare = commands.add_parser("compare", help="run two programs and compare their outputs")
    compare.add_argument("first", type=Path, metavar="A.pt2")
    compare.add_argument("second", type=Path, metavar="B.pt2")
    compare.add_argument("--inputs", type=Path, metavar="INPUTS.pt")
    _add_import_option(compare)

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


def _add_cast_options(parser: argparse.ArgumentParser) -> None:
    _add_import_option(parser)
    parser.add_argument(
        "--policy",
        default="default",
        metavar="NAME",
        help="default, always_fp32, always_fp16, auto_mixed, "
        "auto_mixed_conservative, auto_mixed_bf16, autocast",
    )
    parser.add_argument(
        "--explicit-fp32",
        choices=EXPLICIT_FP32_CHOICES,
        default=None,
        help="the model's own fp32 regions: kept on evidence (calibrated, the policy's "
        "default), always (keep) or never (retarget)",
    )
    parser.add_argument("--int16", choices=INT16_MODES, default="proven")
    parser.add_argument("--keep-io-types", action="store_true")
    parser.add_argument(
        "--calibrate",
        type=Path,
        metavar="INPUTS.pt",
        help="a list of input tuples saved with torch.save",
    )
    parser.add_argument("--max-rel-error", type=float, metavar="X")
    parser.add_argument("--quiet", action="store_true", help="no progress bars, no summary")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return COMMANDS[args.command](args)
    except (CommandError, Fx16Error) as error:
        print(f"fx16: error: {error}", file=sys.stderr)
        return BUDGET_NOT_MET if isinstance(error, AccuracyBudgetError) else BAD_INPUT
    except BrokenPipeError:  # the reader stopped (fx16 inspect ... | head): not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (the exit flush writes here)
        return 0


# ---- commands ---------------------------------------------------------------------------


def cast_command(args) -> int:
    source = _existing_program_path(args.input)
    target = args.output.expanduser()
    if target.resolve() == source.resolve() and not args.force:
        raise CommandError(f"{target} is the input file; pass --force to overwrite it")
    if not target.parent.is_dir():
        raise CommandError(f"directory {target.parent} does not exist")
    ep, report, error = _cast(source, args)
    if not args.quiet:
        _summarise(report, error, out=sys.stdout)
    if args.report is not None:
        args.report.write_text(report.to_json())
    if not args.dry_run:
        torch.export.save(ep, target)
        if not args.quiet:
            print(f"wrote {target}")
    return 0


def inspect_command(args) -> int:
    if args.html is not None and not args.html.expanduser().parent.is_dir():
        raise CommandError(f"directory {args.html.expanduser().parent} does not exist")
    _, report, error = _cast(_existing_program_path(args.input), args)
    if args.html is not None:
        args.html.expanduser().write_text(report_html(report, args.input.name))
    rows = report.rows if args.all else report.kept_wide()
    if len(report.rows) > LAYER_SUMMARY_ROWS:  # a big model: its layers first
        print("\n".join(report.by_layer()), end="\n\n")
    print(format_rows(rows), end="\n\n")
    _summarise(report, error, out=sys.stdout)
    return 0


def compare_command(args) -> int:
    first = _load(_existing_program_path(args.first), args)
    second = _load(_existing_program_path(args.second), args)
    calls = _read_inputs(args.inputs) if args.inputs else _example_calls(first)
    if not calls:
        raise CommandError(f"{args.first} records no example inputs: pass --inputs INPUTS.pt")
    for path, program in ((args.first, first), (args.second, second)):
        calibration_calls(Program(program), calls, label=f"{path}'s inputs")
    columns = ("input", "output", "shape", "A dtype", "B dtype", "max |A-B|", "rel. error")
    print("{:>5} {:>6} {:18} {:10} {:10} {:>12} {:>11}".format(*columns))
    for call, (call_args, call_kwargs) in enumerate(calls):
        outputs = [Program(program).run(call_args, call_kwargs) for program in (first, second)]
        for index, (a, b) in enumerate(zip(*outputs)):
            if not isinstance(a, torch.Tensor):
                continue
            difference = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            print(
                f"{call:>5} {index:>6} {str(tuple(a.shape)):18} {dtype_name(a.dtype):10} "
                f"{dtype_name(b.dtype):10} {difference:>12.4g} {relative_error(a, b):>11.3g}"
            )
    return 0


def demo_command(args) -> int:
    run_demo()
    return 0


COMMANDS = {
    "cast": cast_command,
    "inspect": inspect_command,
    "compare": compare_command,
    "demo": demo_command,
}


# ---- helpers ----------------------------------------------------------------------------


def _existing_program_path(path: Path) -> Path:
    path = path.expanduser()
    if not path.exists():
        raise CommandError(f"{path} does not exist")
    if not path.is_file():
        raise CommandError(f"{path} is not a file")
    return path


def _load(path: Path, args):
    """The program in ``path``, after importing the modules ``--import`` names."""
    import_modules(args.imports)
    return load_program(path)


def _read_inputs(path: Path) -> list[tuple[tuple, dict]]:
    if not path.exists():
        raise CommandError(f"{path} does not exist")
    try:
        loaded = torch.load(path, weights_only=False)
    except Exception as error:
        raise CommandError(
            f"cannot read inputs from {path}: expected a list of input tuples saved with "
            f"torch.save ({one_line(error)})"
        ) from error
    entries = loaded if isinstance(loaded, list) else [loaded]
    calls = []
    for entry in entries:
        if isinstance(entry, torch.Tensor):
            entry = (entry,)
        if not isinstance(entry, (tuple, list)):
            raise CommandError(
                f"{path} must hold a list of input tuples, found {type(entry).__name__}"
            )
        calls.append((tuple(entry), {}))
    return calls


def _example_calls(ep) -> list[tuple[tuple, dict]]:
    return [ep.example_inputs] if ep.example_inputs is not None else []


def _cast(source: Path, args):
    """Load, cast (a copy's outputs kept as the fp32 reference) and report."""
    ep = _load(source, args)
    policy = resolve_policy(
        args.policy, explicit_fp32=args.explicit_fp32, keep_io_types=args.keep_io_types or None
    )
    calls = _read_inputs(args.calibrate) if args.calibrate else _example_calls(ep)
    calls = calibration_calls(Program(ep), calls, label=str(args.calibrate or "example inputs"))
    references = [Program(ep).run(a, k) for a, k in calls[:1]]
    cast_to_16_bit_precision(
        ep,
        policy=policy,
        int16=args.int16,
        calibration=[(a, k) for a, k in calls] if args.calibrate else None,
        max_rel_error=args.max_rel_error,
        progress=False if args.quiet else None,
    )
    error = None
    if references:
        got = Program(ep).run(*calls[0])
        error = max(
            (
                relative_error(r, g)
                for r, g in zip(references[0], got)
                if isinstance(r, torch.Tensor) and r.is_floating_point()
            ),
            default=None,
        )
    return ep, report_of(ep), error


def _summarise(report, error, out) -> None:
    """The report's totals (as ``inspect`` prints them) and the error against fp32: the
    accuracy search's own, over the calibration inputs, when it ran."""
    for line in report.summary():
        print(line, file=out)
    if report.accuracy is None and error is not None:
        print(f"max relative error vs fp32: {error:.3g} on the first input", file=out)


if __name__ == "__main__":
    sys.exit(main())
