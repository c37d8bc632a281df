"""The options the commands share: the program's imports, the report, the timings, and
for ``fx16 cast`` and ``fx16 inspect`` the policy and its overrides, the fp16 cast's
settings, calibration and the accuracy budget. Parsing only: nothing
heavy is imported, so ``--help`` answers at once."""

import argparse
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
    TARGETS,
)
from fx16.cli.exits import BUDGET_NOT_MET


def add_import_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE before loading (it registers the output types the program "
        "returns; the module of a type the archive names is imported without asking)",
    )


def add_report_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report", type=Path, metavar="REPORT.json", help="write the decision report as JSON"
    )


def add_timings_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timings",
        action="store_true",
        help="print on stderr where the time goes (start-up, load, reference run, cast, save)",
    )


def add_cast_options(parser: argparse.ArgumentParser) -> None:
    add_import_option(parser)
    presets = "; ".join(f"{name}: {meaning}" for name, meaning in POLICY_PRESETS.items())
    parser.add_argument(
        "--policy",
        default="default",
        metavar="NAME",
        help=f"a preset ({presets})",
    )
    parser.add_argument(
        "--target",
        choices=tuple(TARGETS),
        default=None,
        help="where the program will run: the settings that trade accuracy for its cost "
        "(neural_engine: --explicit-fp32 calibrated; gpu: --range-fallback bf16; cpu: "
        "accuracy first); an explicit setting wins",
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
        "--ignore-op",
        dest="ignored_ops",
        action="append",
        default=[],
        metavar="OP",
        help="keep every call of this op in fp32, as coreai-opt's ignored_ops (an op or "
        "overload name: exp, aten.exp, aten.exp.default, mylib::dequant); repeatable",
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
    add_timings_option(parser)


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


def op_by_name(name: str):
    """The op ``name`` names: "exp" (an ATen op, every overload), "aten.exp.default" or
    "exp.default" (one overload), "mylib::dequant" or "mylib::dequant.default"; asked
    after the program loads (which registers its custom ops)."""
    import torch  # here: the parser is built without torch (``fx16 --version``)

    from fx16.cli.files import CommandError

    if "::" in name:
        namespace, _, rest = name.partition("::")
        candidates = [(namespace, *rest.split("."))]
    else:
        parts = name.split(".")
        candidates = [("aten", *parts), tuple(parts)]  # "exp.default", or "aten.exp"
    for namespace, packet, *overload in (c for c in candidates if len(c) >= 2):
        try:
            op = getattr(getattr(torch.ops, namespace), packet)
            return getattr(op, overload[0]) if overload else op
        except (AttributeError, RuntimeError, IndexError, ValueError):
            continue
    raise CommandError(
        f"--ignore-op {name}: no such op (an op or overload: exp, aten.exp.default, "
        "mylib::dequant; a custom op's library must be imported: --import)"
    )
