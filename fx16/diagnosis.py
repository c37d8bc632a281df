"""Where a cast program loses accuracy: every value against fp32, the first divergence,
and the ops that amplify error most.

``diagnose(reference, cast, inputs)`` runs the fp32 program and the cast program
side by side, node by node, and aligns their values by stable node id
(``fx16.program.node_ids``), never by guessing from names: casts fx16 inserted have no id
and are skipped, retargeted casts keep theirs, removed casts are simply not met in
the cast program, and the bodies of ``cond``, ``while_loop``, ``map`` and
``invoke_subgraph`` are walked too (each iteration, each slice: a value's error is
its worst over them). Autocast and ``set_grad_enabled`` regions run whole: their
results are compared, not the values inside.

For every value: its relative error against fp32 (max |cast - fp32| / max |fp32|,
in fp64, its worst over the inputs; a value a scale domain carries at ``2**e``
(``fx16.meta.scale_exponent``) is compared with its fp32 counterpart times ``2**e``,
exact in fp64, so a scale reads as no error), and its amplification: that error divided by
the worst error of the values it reads (at least the 16-bit unit roundoff, so an op
that only rounds its result has an amplification near 1).

Memory: both programs run in lockstep, one node at a time; each frees a value after
its last use, and a reference value waits only until the cast program computes the
same node (the order is the same: a cast only inserts and removes casts). What is
kept per value is a few numbers. So the extra memory is a few activations of each
program, not two full sets.
"""

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from fx16.analysis.calibration_inputs import calibration_calls
from fx16.errors import InvalidOptionError, InvalidProgramError, one_line, require_number
from fx16.meta import scale_exponent
from fx16.plan.steps import explained
from fx16.program import Program
from fx16.program.node_ids import graph_modules, has_ids, node_id
from fx16.program.nodes import dtype_name, node_module_path, op_label
from fx16.program.stats import relative_error
from fx16.program.values import program_values
from fx16.report import json_ready
from fx16.report.saved import kept_decision

DEFAULT_THRESHOLD = 1e-2
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_FILE = re.compile(r"[/\\]torch[/\\]")


@dataclass
class ValueReport:
    """One value of the program, compared with fp32."""

    id: str
    op: str
    module: str
    source: str  # file:line of the model code that made it (from stack_trace), or ""
    dtype: str  # as the cast program computes it
    error: float  # relative to fp32, its worst over the inputs (and iterations)
    amplification: float = 1.0
    decision: str = ""  # fx16's rule and reason for it in the cast program
    scale_exponent: int = 0  # e where the cast program carries the value at 2**e

    def carried(self) -> str:
        """The dtype, with the scale the value is carried at ("float16 at 2**-3")."""
        return self.dtype + (f" at 2**{self.scale_exponent}" if self.scale_exponent else "")

    def describe(self) -> str:
        where = " ".join(part for part in (self.module, self.source) if part)
        decided = f"; fx16: {self.decision}" if self.decision else ""
        return (
            f"{self.id} ({self.op}, {self.carried()}) error {self.error:.3g}, amplifies "
            f"{self.amplification:.3g}x{' at ' + where if where else ''}{decided}"
        )


@dataclass
class Diagnosis:
    """Every aligned value in the reference's order, with what stands out."""

    values: list[ValueReport]
    threshold: float
    first_divergence: ValueReport | None
    amplifiers: list[ValueReport] = field(default_factory=list)
    unaligned: int = 0  # reference values the cast program does not compute (removed casts)

    def summary(self) -> list[str]:
        lines = []
        if self.first_divergence is None:
            lines.append(f"no value differs from fp32 by more than {self.threshold:g}")
        else:
            lines.append(f"first value over {self.threshold:g}: {self.first_divergence.describe()}")
        if self.amplifiers:
            lines.append("amplifying most:")
            lines += [f"  {value.describe()}" for value in self.amplifiers]
        return lines

    def table(self, rows: list[ValueReport] | None = None) -> str:
        """A fixed-width table of ``rows`` (default: every value), then the summary."""
        rows = self.values if rows is None else rows
        header = ("id", "op", "dtype", "rel. error", "amplifies", "module", "source")
        cells = [
            (
                v.id,
                v.op,
                v.carried(),
                f"{v.error:.3g}",
                f"{v.amplification:.3g}x",
                v.module,
                v.source,
            )
            for v in rows
        ]
        widths = [
            max([len(title), *(len(row[i]) for row in cells)]) for i, title in enumerate(header)
        ]
        lines = [" ".join(f"{t:{w}}" for t, w in zip(header, widths))]
        lines += [" ".join(f"{c:{w}}" for c, w in zip(row, widths)) for row in cells]
        return "\n".join([*lines, "", *self.summary()])

    def to_json(self) -> str:
        document = {
            "threshold": self.threshold,
            "first_divergence": self.first_divergence and asdict(self.first_divergence),
            "amplifiers": [asdict(value) for value in self.amplifiers],
            "unaligned": self.unaligned,
            "values": [asdict(value) for value in self.values],
        }
        return json.dumps(json_ready(document), indent=2, allow_nan=False)

    def by_id(self) -> dict[str, ValueReport]:
        return {value.id: value for value in self.values}


def diagnose(
    reference: ExportedProgram,
    cast: ExportedProgram,
    inputs: list | None = None,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    top: int = 5,
) -> Diagnosis:
    """Compare every value of ``cast`` with the fp32 program ``reference`` on ``inputs``
    (a list of argument tuples or ``(args, kwargs)`` pairs; None: the reference's
    example inputs). ``threshold``: the relative error that counts as diverging;
    ``top``: how many of the most amplifying ops to name."""
    require_number("threshold", threshold, 0)
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise InvalidOptionError(f"top must be a whole number >= 0, got {top!r}")
    reference_program, cast_program = Program.of(reference), Program.of(cast)
    _check_correspond(reference_program, cast_program)
    calls = calibration_calls(reference_program, inputs, label="diagnose inputs")
    calibration_calls(cast_program, calls, label="diagnose inputs (for the cast program)")
    records: dict[str, _Record] = {}
    with torch.no_grad():  # here, not inside the interleaved runs: each would undo the other's
        for index, (args, kwargs) in enumerate(calls):
            try:
                _compare(reference_program, cast_program, args, kwargs, records)
            except Exception as error:
                raise InvalidProgramError(
                    f"diagnose inputs[{index}]: running the two programs side by side failed "
                    f"({one_line(error)}); is the second a cast of the first?"
                ) from error
    return _diagnosis(reference.graph_module, records, _unit_roundoff(cast), threshold, top)


def _check_correspond(reference: Program, cast: Program) -> None:
    """``InvalidProgramError`` unless ``cast`` can be a cast of ``reference``: the same
    user inputs (by name) and as many user outputs."""
    names = [
        [node.name for node in program.user_input_placeholders()] for program in (reference, cast)
    ]
    outputs = [program.user_output_count() for program in (reference, cast)]
    if names[0] != names[1] or outputs[0] != outputs[1]:
        raise InvalidProgramError(
            f"the programs do not correspond: the first takes inputs {names[0]} and gives "
            f"{outputs[0]} output(s), the second takes {names[1]} and gives {outputs[1]}; "
            "diagnose compares an fp32 program with its own cast"
        )


@dataclass
class _Record:
    reference: Node
    cast: Node
    error: float
    dtype: torch.dtype
    scale_exponent: int = 0


def _compare(reference: Program, cast: Program, args, kwargs, records: dict) -> None:
    """Run both programs on one call in lockstep and record each aligned value's error."""
    cast_ids = _ids(cast.graph_module)
    ahead: dict = {}  # reference values computed before the cast program reached them
    ref_stream = program_values(reference, reference.graph_inputs(args, kwargs))
    cast_inputs = cast.graph_inputs(*cast.adapt_call(args, kwargs))
    for key, node, value in program_values(cast, cast_inputs):
        while key not in ahead:
            try:
                ref_key, ref_node, ref_value = next(ref_stream)
            except StopIteration:
                break
            if ref_key[0] in cast_ids:  # a removed cast is never asked for: do not keep it
                ahead[ref_key] = (ref_node, ref_value)
        if key not in ahead:
            continue
        ref_node, ref_value = ahead.pop(key)
        if not (isinstance(value, torch.Tensor) and isinstance(ref_value, torch.Tensor)):
            continue
        exponent = scale_exponent(node)
        if exponent and ref_value.is_floating_point():
            ref_value = ref_value.double() * 2.0**exponent  # as the cast program carries it
        error = value_error(ref_value, value)
        known = records.get(key[0])
        if known is None or error > known.error:
            records[key[0]] = _Record(ref_node, node, error, value.dtype, exponent)


def value_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    """The relative error of ``value`` against ``reference`` (inf for integers or shapes
    that differ at all). A masking sentinel beyond 16-bit's range (-3.4e38, finfo.min)
    that the cast program holds as its dtype's largest value, or as inf, of the same
    sign, is not an error: it masks the same way."""
    if value.shape != reference.shape or not reference.is_floating_point():
        return 0.0 if torch.equal(value, reference.to(value.dtype)) else math.inf
    narrower = value.is_floating_point() and value.element_size() < reference.element_size()
    if narrower:
        top = torch.finfo(value.dtype).max
        saturated = (reference.abs() > top) & (value.abs() >= top)
        saturated &= torch.sign(reference) == torch.sign(value)
        if bool(saturated.any()):
            reference, value = reference.masked_fill(saturated, 0), value.masked_fill(saturated, 0)
    return relative_error(reference, value)


def _ids(root: GraphModule) -> set[str]:
    assigned = has_ids(root)
    found = set()
    for prefix, module in graph_modules(root):
        for node in module.graph.nodes:
            found.add(node_id(node, prefix, assigned))
    return found


def _unit_roundoff(cast: ExportedProgram) -> float:
    """Half the machine epsilon of the 16-bit dtype the cast program computes in."""
    dtypes = {
        value.dtype
        for node in cast.graph_module.graph.nodes
        for value in [node.meta.get("val")]
        if isinstance(value, torch.Tensor)
    }
    low = (
        torch.bfloat16
        if torch.bfloat16 in dtypes and torch.float16 not in dtypes
        else torch.float16
    )
    return torch.finfo(low).eps / 2


def _diagnosis(reference_root, records, roundoff, threshold, top) -> Diagnosis:
    assigned = has_ids(reference_root)
    ordered, unaligned = [], 0
    for prefix, module in graph_modules(reference_root):
        for node in module.graph.nodes:
            identity = node_id(node, prefix, assigned)
            if identity is None or node.op != "call_function":
                continue
            record = records.get(identity)
            if record is None:
                unaligned += 1
                continue
            read = [records.get(node_id(arg, prefix, assigned)) for arg in node.all_input_nodes]
            worst_read = max((r.error for r in read if r is not None), default=0.0)
            ordered.append(_value(identity, record, worst_read, roundoff))
    first = next((value for value in ordered if value.error > threshold), None)
    noticeable = [value for value in ordered if value.error > roundoff]
    amplifiers = sorted(noticeable, key=lambda value: -value.amplification)[:top]
    return Diagnosis(ordered, threshold, first, amplifiers, unaligned)


def _value(identity: str, record: _Record, worst_read: float, roundoff: float) -> ValueReport:
    error = record.error
    amplification = error / max(worst_read, roundoff) if math.isfinite(error) else math.inf
    said = explained(record.cast) or kept_decision(record.cast)  # a loaded program: text
    return ValueReport(
        id=identity,
        op=op_label(record.reference),
        module=node_module_path(record.reference) or "",
        source=source_line(record.reference),
        dtype=dtype_name(record.dtype),
        error=error,
        amplification=amplification,
        decision=said,
        scale_exponent=record.scale_exponent,
    )


def source_line(node: Node) -> str:
    """file:line of the model code that made ``node``: the innermost frame of its
    ``stack_trace`` outside torch (a Linear's frame is the model's ``self.fc(x)``, not
    torch's ``F.linear``), relative to the working directory when under it; "" if
    unknown."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    outside_torch = [frame for frame in frames if not _TORCH_FILE.search(frame[0])]
    path, line = (outside_torch or frames)[-1]
    relative = os.path.relpath(path)
    return f"{path if relative.startswith('..') else relative}:{line}"
