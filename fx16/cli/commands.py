"""What each ``fx16`` command does once ``fx16.cli`` has parsed it.

Inputs are checked before anything runs: each input against what the program takes
(count, shape, integer or float), and a program that fails on one (an id past the
vocabulary) is one line on stderr naming the input, never a traceback.
"""

import os
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fx16.analysis.calibration_inputs import calibration_calls
from fx16.casting import cast_to_16_bit_precision
from fx16.cli.exits import BAD_INPUT, BUDGET_NOT_MET
from fx16.cli.files import (
    CommandError,
    example_calls,
    existing_program_path,
    load_with_imports,
    read_inputs,
    run_or_name_input,
    save_program,
    writable_path,
    writable_program_path,
)
from fx16.cli.options import op_by_name
from fx16.cli.timings import Timings
from fx16.demo import run_demo
from fx16.errors import AccuracyBudgetError, Fx16Error
from fx16.policy import PrecisionPolicy, resolve_policy
from fx16.program import Program
from fx16.program.nodes import dtype_name
from fx16.program.stats import nonfinite_mismatches, relative_error
from fx16.report import format_rows, report_of
from fx16.report.html import report_html
from fx16.report.saved import restore_decisions

# Above this many values, inspect opens with a summary per layer.
LAYER_SUMMARY_ROWS = 60


class ThresholdMissed(Exception):
    """compare --max-rel-error: an output differs by more than the threshold."""


@dataclass(frozen=True)
class AgainstFp32:
    """The cast program's outputs against the fp32 program's on the first input: the
    relative error over fp32's finite values, and how many of its inf and NaN values
    the cast does not reproduce."""

    error: float
    nonfinite_missed: int


def run(args, started: float) -> int:
    """Run the parsed command; the exit code."""
    timings = Timings(started, getattr(args, "timings", False))
    timings.lap("start-up (Python, torch, fx16)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            code = COMMANDS[args.command](args, timings)
        timings.print()
        return code
    except (CommandError, Fx16Error, ThresholdMissed) as error:
        print(f"fx16: error: {error}", file=sys.stderr)
        missed = isinstance(error, (AccuracyBudgetError, ThresholdMissed))
        return BUDGET_NOT_MET if missed else BAD_INPUT
    except BrokenPipeError:  # the reader stopped (fx16 inspect ... | head): not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (the exit flush writes here)
        return 0


# ---- commands ---------------------------------------------------------------------------


def cast_command(args, timings: Timings) -> int:
    source = existing_program_path(args.input)
    if args.output is None and not args.dry_run:
        raise CommandError("the cast program needs somewhere to go: pass -o OUT.pt2 (or --dry-run)")
    if args.output is not None:
        target = writable_program_path(args.output, source, args.force)
    writable_path(args.report, "--report", "REPORT.json")
    policy, ep = _load(source, args, timings)
    report, error = _cast(ep, source, policy, args, timings)
    if not args.quiet:
        _summarise(report, error, out=sys.stdout)
    if args.report is not None:
        args.report.write_text(report.to_json())
    if not args.dry_run:
        save_program(ep, target)
        timings.lap("save")
        if not args.quiet:
            print(f"wrote {target}")
    _validation_missed(report)
    return 0


def inspect_command(args, timings: Timings) -> int:
    writable_path(args.html, "--html", "OUT.html")
    writable_path(args.report, "--report", "REPORT.json")
    source = existing_program_path(args.input)
    policy, ep = _load(source, args, timings)
    already_cast = restore_decisions(ep.graph_module)
    if already_cast:  # what the cast that wrote it decided, not a cast of its 16-bit program
        report, error = report_of(ep), None
        print(f"{args.input} is a program fx16 cast: its report, as that cast made it\n")
    else:
        report, error = _cast(ep, source, policy, args, timings)
    if args.html is not None:
        errors = None if already_cast else _errors_against_fp32(source, ep, args)
        args.html.expanduser().write_text(report_html(report, args.input.name, errors))
        timings.lap("errors vs fp32, value by value, and the page")
    if args.report is not None:
        args.report.write_text(report.to_json())
    rows = report.rows if args.all else report.explained()
    if len(report.rows) > LAYER_SUMMARY_ROWS:  # a big model: its layers first
        print("\n".join(report.by_layer()), end="\n\n")
    print(format_rows(rows), end="\n\n")
    _summarise(report, error, out=sys.stdout)
    _validation_missed(report)
    return 0


def compare_command(args, timings: Timings) -> int:
    writable_path(args.json, "--json", "OUT.json")
    first = load_with_imports(existing_program_path(args.first), args)
    second = load_with_imports(existing_program_path(args.second), args)
    timings.lap("load")
    calls = read_inputs(args.inputs) if args.inputs else example_calls(first)
    if not calls:
        raise CommandError(f"{args.first} records no example inputs: pass --inputs INPUTS.pt")
    for path, program in ((args.first, first), (args.second, second)):
        calibration_calls(Program.of(program), calls, label=f"{path}'s inputs")
    if args.per_node:
        _compare_per_node(first, second, calls, args, timings)
        print()
    columns = ("input", "output", "shape", "A dtype", "B dtype", "max |A-B|", "rel. error")
    print("{:>5} {:>6} {:18} {:10} {:10} {:>12} {:>11}".format(*columns))
    worst, unmatched = 0.0, []
    for call, (call_args, call_kwargs) in enumerate(calls):
        outputs = [
            run_or_name_input(program, (call_args, call_kwargs), f"{path}'s inputs[{call}]")
            for path, program in ((args.first, first), (args.second, second))
        ]
        for index, (a, b) in enumerate(zip(*outputs)):
            if not isinstance(a, torch.Tensor):
                continue
            difference = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            error = relative_error(a, b)
            worst = max(worst, error)
            missed = nonfinite_mismatches(a, b)
            if missed:
                unmatched.append(f"input {call} output {index}: {_nonfinite_note(missed)}")
            print(
                f"{call:>5} {index:>6} {str(tuple(a.shape)):18} {dtype_name(a.dtype):10} "
                f"{dtype_name(b.dtype):10} {difference:>12.4g} {error:>11.3g}"
                + (" (!)" if missed else "")
            )
    timings.lap("run both")
    for line in unmatched:
        print(f"(!) {line}")
    if args.max_rel_error is not None and worst > args.max_rel_error:
        raise ThresholdMissed(
            f"outputs differ by {worst:.3g} (relative), more than --max-rel-error "
            f"{args.max_rel_error:g}"
        )
    if args.max_rel_error is not None and unmatched:
        raise ThresholdMissed(
            f"{len(unmatched)} output(s) of A hold inf or NaN that B does not reproduce "
            "(their relative error covers the finite values only)"
        )
    return 0


def _nonfinite_note(count: int, reference: str = "A", other: str = "B") -> str:
    return (
        f"{reference} holds {count} inf or NaN value(s) that {other} does not reproduce; "
        f"the relative error covers {reference}'s finite values only"
    )


def _compare_per_node(reference, cast, calls, args, timings: Timings) -> None:
    """``compare --per-node``: the diagnosis of ``cast`` against ``reference``: the values
    over the threshold as a table (the first ``PER_NODE_ROWS``), then the first
    divergence and the strongest amplifiers (the outputs' comparison follows)."""
    from fx16.diagnosis import diagnose

    diagnosis = diagnose(reference, cast, calls, threshold=args.threshold)
    timings.lap("run both, value by value")
    over = [value for value in diagnosis.values if value.error > args.threshold]
    print(f"{len(diagnosis.values)} values compared, {len(over)} over {args.threshold:g}")
    if over:
        print(diagnosis.table(over[:PER_NODE_ROWS]))
    else:
        print(f"no value differs by more than {args.threshold:g} (relative)")
    if args.json:
        args.json.write_text(diagnosis.to_json())


PER_NODE_ROWS = 20


def demo_command(args, timings: Timings) -> int:
    run_demo()
    return 0


COMMANDS = {
    "cast": cast_command,
    "inspect": inspect_command,
    "compare": compare_command,
    "demo": demo_command,
}


# ---- helpers ----------------------------------------------------------------------------


def _errors_against_fp32(source: Path, cast, args) -> dict | None:
    """Each node's (relative error, amplification) against the fp32 program on the first
    calibration input, by name (None without inputs)."""
    from fx16.diagnosis import diagnose

    reference = load_with_imports(source, args)
    calls = read_inputs(args.calibrate) if args.calibrate else example_calls(reference)
    if not calls:
        return None
    found = diagnose(reference, cast, calls[:1])
    return {value.id: (value.error, value.amplification) for value in found.values}


def _validation_calls(ep, args) -> list | None:
    """``--validate``'s inputs, checked against the program like the calibration's."""
    if args.validate is None:
        return None
    calls = read_inputs(args.validate)
    return calibration_calls(Program.of(ep), calls, label=str(args.validate))


def _validation_missed(report) -> None:
    """Exit code 3 (after the program is written) when ``--validate`` misses the budget."""
    search = report.accuracy
    if search is not None and search.validation_met is False:
        raise ThresholdMissed(
            f"the validation inputs' error {search.validation_error:.3g} exceeds the budget "
            f"{search.budget:.3g} (calibration: {search.error:.3g})"
        )


def _policy(args) -> PrecisionPolicy:
    """The preset ``--policy`` names, with the command line's settings and overrides."""
    keep = True if args.keep_io_types else frozenset(args.keep_io) or None
    policy = resolve_policy(
        args.policy,
        target=args.target,
        explicit_fp32=args.explicit_fp32,
        keep_io_types=keep,
        stabilize=args.stabilize,
        eps_clamp=args.eps_clamp,
        routing=args.routing,
        range_fallback=args.range_fallback,
    )
    overrides = {
        table: {**getattr(policy, table), **dict(getattr(args, table))}
        for table in ("modules", "ops", "nodes")
        if getattr(args, table)
    }
    if not overrides:
        return policy
    return PrecisionPolicy.custom(policy, name=f"{policy.name} with overrides", **overrides)


def _load(source: Path, args, timings: Timings):
    """The policy the command line names (checked before the program loads), the program."""
    policy = _policy(args)
    ep = load_with_imports(source, args)
    timings.lap("load")
    return policy, ep


def _cast(ep, source: Path, policy: PrecisionPolicy, args, timings: Timings):
    """Check the inputs, keep the fp32 outputs of the first as the reference, cast
    ``ep`` (loaded from ``source``) in place with ``policy``; returns the report and
    the error against fp32."""
    label = str(args.calibrate or "example inputs")
    calls = read_inputs(args.calibrate) if args.calibrate else example_calls(ep)
    calls = calibration_calls(Program.of(ep), calls, label=label)  # count, shapes, dtypes
    references = [run_or_name_input(ep, call, f"{label}[0]") for call in calls[:1]]
    timings.lap("inputs checked and fp32 reference run")
    cast_to_16_bit_precision(
        ep,
        policy=policy,
        int16=args.int16,
        input_ranges=dict(args.input_ranges) or None,
        calibration=list(calls) if args.calibrate else None,
        max_rel_error=args.max_rel_error,
        target_share=args.target_share,
        metric=args.metric,
        validation=_validation_calls(ep, args),
        scalars=args.scalars,
        ignored_ops=[op_by_name(name) for name in args.ignored_ops] or None,
        overflow_margin=args.overflow_margin,
        progress=False if args.quiet else None,
    )
    timings.lap("cast")
    error = None
    if references:
        got = Program.of(ep).run(*calls[0])
        pairs = [
            (r, g)
            for r, g in zip(references[0], got)
            if isinstance(r, torch.Tensor) and r.is_floating_point()
        ]
        if pairs:
            error = AgainstFp32(
                max(relative_error(r, g) for r, g in pairs),
                sum(nonfinite_mismatches(r, g) for r, g in pairs),
            )
    report = report_of(ep)
    report = replace(report, provenance={**report.provenance, "input": str(source)})
    timings.lap("error check and report")
    return report, error


def _summarise(report, error, out) -> None:
    """The report's totals (as ``inspect`` prints them) and the error against fp32: the
    accuracy search's own, over the calibration inputs, when it ran."""
    for line in report.summary():
        print(line, file=out)
    if report.accuracy is None and error is not None:
        print(f"max relative error vs fp32: {error.error:.3g} on the first input", file=out)
        if error.nonfinite_missed:
            note = _nonfinite_note(error.nonfinite_missed, "fp32", "the cast")
            print(f"(!) {note}", file=out)
