"""The decision report: what fx16 did to a program, node by node and in total.

Every public cast function stores a ``CastReport`` in
``ep.graph_module.meta["fx16.report"]`` (it lives with the program object; it is
not saved in ``.pt2`` files, so write ``to_json()`` where you need it kept).
"""

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from fx16 import meta
from fx16.analysis.explicit_fp32 import islands
from fx16.analysis.intervals import ValueRange
from fx16.budget import AccuracySearch
from fx16.casts import INSERTED, WHY_RETARGETED, is_inserted
from fx16.cost import flops, is_product, tensor_bytes
from fx16.decisions import INT_PRECISION, PRECISION, Decision, Reason
from fx16.int_ops import WIDE_INT_DTYPES
from fx16.nodes import dtype_name, node_dtype, node_module_path, node_val, op_label
from fx16.program import Program
from fx16.stats import BEFORE_KEY, ProgramStats, program_stats

REPORT_KEY = "fx16.report"
# Rules of integer rows outside the castable set (see CastReport.explained).
_OUTSIDE_CASTABLE_SET = (Reason.NOT_USER_REACHABLE, Reason.NOT_CASTABLE, Reason.UNSAFE_INDEX)
_NEVER_INT16_CANDIDATES = frozenset(
    {"left_as_is"} | {r.name.lower() for r in _OUTSIDE_CASTABLE_SET}
)
_SLOT_KINDS = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer"}
LEFT_AS_IS = "not fp32: left as the model computes it"


@dataclass(frozen=True)
class Row:
    node: str
    op: str
    kind: str  # "float" or "int"
    dtype: str
    narrowed: bool
    rule: str  # short name of the rule that decided, e.g. "activation_overflow"
    reason: str
    detail: str
    module: str = ""  # the module path the node belongs to ("model.layers.0.mlp"), if known
    flops: int = 0  # what the op computes per call (in the dtype above)
    product: bool = False  # a matrix product, convolution or attention
    bytes: int = 0  # what the value holds (for a weight kept fp32, the bytes it keeps)
    # the numbers behind the decision, where the analyses found them
    observed: tuple[float, float] | None = None  # smallest and largest on calibration
    observed_max_abs: float | None = None  # largest magnitude on calibration
    proven: tuple[float, float] | None = None  # an integer value's proven range
    condition_number: float | None = None  # an ill-conditioned op's
    # an fp32 result whose consumers read it in fp32 (no cast back to 16-bit): why
    cast_back_skipped: str = ""
    # the stable rewrite (StabilizePass) that made this value: "rule: detail"
    stabilized: str = ""

    def cost(self) -> str:
        """What keeping this value in fp32 costs per call, for a row that does."""
        if self.narrowed or self.kind != "float" or self.rule == "left_as_is":
            return ""
        if self.flops:
            return f"{human(self.flops)}FLOPs" + (
                " (matmul/conv/attention)" if self.product else ""
            )
        return f"{human(self.bytes)}B" if self.bytes else ""  # a weight, an input


@dataclass(frozen=True)
class Totals:
    weight_bytes_before: int
    weight_bytes_after: int
    casts_before: int
    casts_after: int
    casts_inserted: int
    model_casts_removed: int | None  # None: not known (a report built after the fact)
    float_ops: int
    float_ops_16bit: int
    product_flops: int = 0  # matrix products, convolutions, attention: FLOPs per call
    product_flops_16bit: int = 0  # of those, computed in 16-bit
    cast_bytes: int = 0  # bytes every cast of the program reads and writes per call
    fp32_weight_bytes: int = 0

    @property
    def share_16bit(self) -> float:
        return self.float_ops_16bit / self.float_ops if self.float_ops else 1.0

    @property
    def flop_share_16bit(self) -> float:
        """The headline figure: the share of matmul/conv/attention FLOPs in 16-bit."""
        return self.product_flops_16bit / self.product_flops if self.product_flops else 1.0


class Pending:
    """A report's rows and totals, built from the program when first read.

    A cast does not pay for a report nobody reads (building it costs about as much as
    the walk that decides). It shows the program as it is when first read: read it
    before rewriting the graph further."""

    def __init__(self, ep: ExportedProgram, before: ProgramStats | None) -> None:
        self.ep = ep  # an attribute, not a closure: a deep copy of the program gets its own
        self.before = before
        self.built: tuple[list[Row], Totals] | None = None

    def __call__(self) -> tuple[list[Row], Totals]:
        if self.built is None:
            self.built = decision_rows(self.ep), totals(self.ep, self.before)
            self.ep = None
        return self.built


@dataclass(frozen=True)
class CastReport:
    source: "Pending | tuple[list[Row], Totals]" = field(repr=False)
    accuracy: AccuracySearch | None = None  # set when the cast had an accuracy budget
    # what made it: fx16 and torch versions, the entry point, its options, the input file
    provenance: dict = field(default_factory=dict)

    @property
    def rows(self) -> list[Row]:
        """One row per value fx16 decided (see ``decision_rows``), built on first use."""
        return self.built()[0]

    @property
    def totals(self) -> Totals:
        return self.built()[1]

    def built(self) -> tuple[list[Row], Totals]:
        source = self.source
        return source() if isinstance(source, Pending) else source

    def kept_wide(self) -> list[Row]:
        return [row for row in self.rows if not row.narrowed]

    def explained(self) -> list[Row]:
        """The rows a reader asks "why" about: values kept wide, except integers that
        were never int16 candidates (outside the castable set: constant-foldable, not
        integer arithmetic, index computations; or undecided). A model has many such
        integers (positions, masks, shapes) and they would bury the float rows."""
        return [
            row
            for row in self.kept_wide()
            if row.kind == "float" or row.rule not in _NEVER_INT16_CANDIDATES
        ]

    def to_json(self) -> str:
        """The report as JSON: provenance, totals, accuracy, and a row per node with its
        numbers (ranges, condition numbers; infinities as "inf"), for tools to read."""
        totals = {
            **asdict(self.totals),
            "flop_share_16bit": round(self.totals.flop_share_16bit, 6),
            "share_16bit": round(self.totals.share_16bit, 4),
        }
        document = {
            "provenance": self.provenance,
            "totals": totals,
            "nodes": [asdict(r) for r in self.rows],
        }
        if self.accuracy is not None:
            document["accuracy"] = {**asdict(self.accuracy), "met": self.accuracy.met}
        return json.dumps(json_ready(document), indent=2, allow_nan=False)

    def table(self, rows: list[Row] | None = None) -> str:
        """A fixed-width table of ``rows`` (default: every row), then the totals."""
        return "\n".join([format_rows(self.rows if rows is None else rows), "", *self.summary()])

    def summary(self) -> list[str]:
        """The totals, as the command line prints them after a cast and under a table."""
        t = self.totals
        ratio = t.weight_bytes_after / t.weight_bytes_before if t.weight_bytes_before else 1.0
        removed = (
            f", {t.model_casts_removed} of the model's removed"
            if t.model_casts_removed is not None
            else ""
        )
        narrowed = sum(row.narrowed for row in self.rows if row.kind == "int")
        floats = [row for row in self.rows if row.kind == "float" and row.narrowed]
        low = sorted({row.dtype for row in floats} & {"float16", "bfloat16"})
        lines = [
            f"matmul/conv/attention FLOPs in 16-bit: {t.flop_share_16bit:.2%} of "
            f"{human(t.product_flops)} per call",
            f"weight bytes: {t.weight_bytes_before} -> {t.weight_bytes_after} ({ratio:.2f}x)",
            f"casts: {t.casts_before} -> {t.casts_after} ({t.casts_inserted} inserted by fx16"
            f"{removed}; {human(t.cast_bytes)}B moved per call)",
            f"float ops in 16-bit: {t.float_ops_16bit} of {t.float_ops} ({t.share_16bit:.0%}"
            f"{'; ' if low else ''}{', '.join(low)})",
            f"integer values narrowed to int16: {narrowed}",
        ]
        stabilized = Counter(row.stabilized.split(":")[0] for row in self.rows if row.stabilized)
        if stabilized:
            kinds = ", ".join(f"{name} x{count}" for name, count in stabilized.items())
            lines.append(f"stabilized (rewritten for 16-bit): {kinds}")
        if self.accuracy is not None:
            lines.append(self.accuracy.describe())
        return lines

    def by_layer(self) -> list[str]:
        """One line per layer (module path up to its index: "model.layers.3"): the
        share of its matmul/conv/attention FLOPs in 16-bit, how many of its float
        values are 16-bit and fp32, and the rules that kept values fp32."""
        groups = self.layers()
        width = max((len(name) for name in groups), default=5)
        lines = [
            f"{'layer':{width}} {'FLOPs 16-bit':>12} {'16-bit':>7} {'fp32':>5}  "
            "rules keeping float values fp32"
        ]
        for name, rows in groups.items():
            wide = [row for row in rows if not row.narrowed]
            rules = Counter(row.rule for row in wide)
            why = ", ".join(f"{rule} x{count}" for rule, count in rules.items()) or "-"
            lines.append(
                f"{name:{width}} {layer_flop_share(rows):>12} {len(rows) - len(wide):>7} "
                f"{len(wide):>5}  {why}"
            )
        return lines

    def layers(self) -> dict[str, list[Row]]:
        """The float rows by layer, in graph order."""
        groups: dict[str, list[Row]] = {}
        for row in self.rows:
            if row.kind == "float":
                groups.setdefault(layer_of(row.module), []).append(row)
        return groups


def json_ready(value):
    """``value`` with non-finite floats as strings ("inf"), which JSON cannot hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


def layer_flop_share(rows: list[Row]) -> str:
    """The share of the rows' matmul/conv/attention FLOPs in 16-bit ("-" without any)."""
    total = sum(row.flops for row in rows if row.product)
    low = sum(row.flops for row in rows if row.product and row.narrowed)
    return f"{low / total:.0%}" if total else "-"


def human(amount: float) -> str:
    """1234567 as "1.23 M": an amount with an SI prefix."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if amount >= scale:
            return f"{amount / scale:.3g} {prefix}"
    return f"{amount:.3g} "


def _row(
    node: Node, kind: str, decision: Decision | None, body: str = "", inputs: dict | None = None
) -> Row:
    """``inputs``: each graph input of the program by name, as (its kind: "parameter",
    "buffer", "constant", "input"; the module owning it: a weight's node has no module
    stack)."""
    name = f"{body}.{node.name}" if body else node.name
    role, owner = ("", "") if body else (inputs or {}).get(node.name, ("", ""))
    module = node_module_path(node) or owner
    op = role or op_label(node)  # a body's input is a "placeholder"
    costs = {
        "flops": flops(node),
        "product": is_product(node),
        "bytes": tensor_bytes(node_val(node)),
        **_numbers(node),
    }
    if decision is None:
        dtype = node_dtype(node)
        narrowed = dtype == torch.float16
        return Row(
            name,
            op,
            kind,
            dtype_name(dtype),
            narrowed,
            "left_as_is",
            LEFT_AS_IS,
            "",
            module,
            **costs,
        )
    if not decision.detail and kind == "int" and meta.proven_range(node):
        decision = replace(decision, detail=str(meta.proven_range(node)))
    return replace(_decision_row(name, op, kind, decision, module), **costs)


def _numbers(node: Node) -> dict:
    """The ranges and condition number the analyses recorded on ``node``, why its
    consumers read it in fp32 where the inserter gave it no cast-back, and the stable
    rewrite that made it."""
    numbers = {}
    interval = meta.observed_interval(node)
    if interval is not None:
        numbers["observed"] = tuple(map(float, interval))
    magnitude = meta.observed_max_abs(node)
    if magnitude is not None:
        numbers["observed_max_abs"] = float(magnitude)
    proven = meta.proven_range(node)
    if isinstance(proven, ValueRange):
        numbers["proven"] = (float(proven.low), float(proven.high))
    finding = meta.conditioning_finding(node)
    if finding is not None:
        numbers["condition_number"] = float(finding.kappa)
    if meta.cast_back_skipped(node):
        numbers["cast_back_skipped"] = meta.cast_back_skipped(node)
    if meta.stabilized(node):
        name, detail = meta.stabilized(node)
        numbers["stabilized"] = f"{name}: {detail}" if detail else name
    return numbers


def _decision_row(name: str, op: str, kind: str, decision: Decision, module: str = "") -> Row:
    return Row(
        name,
        op,
        kind,
        dtype_name(decision.dtype),
        decision.narrowed,
        decision.reason.name.lower(),
        decision.reason.value,
        decision.detail,
        module,
    )


def layer_of(module: str) -> str:
    """A module path up to its first index ("model.layers.3" of "model.layers.3.mlp")."""
    if not module:
        return "(no module)"
    parts = module.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    return ".".join(parts[: index + 1])


def _island_rows(graph_module: GraphModule, body: str, listed: set[str]) -> list[Row]:
    """Rows for the model's own fp32 casts whose verdict has no row of its own: a
    retargeted cast cleanup removed, a decomposed cast's fp32 check."""
    rows = []
    for island in islands(graph_module):
        name = f"{body}.{island.opening}" if body else island.opening
        if name not in listed:
            reason = Reason.EXPLICIT_FP32 if island.keep else Reason.EXPLICIT_FP32_RETARGETED
            decision = Decision(island.dtype, reason, island.why)
            rows.append(_decision_row(name, island.op, "float", decision))
    return rows


def decision_rows(ep: ExportedProgram) -> list[Row]:
    """One row per float value, then per integer value the int16 pipeline looked at;
    each in the program's graph first, then in the body of each higher-order op (rows
    named ``body.node``, e.g. ``true_graph_0.exp``).

    Casts fx16 inserted are not listed (the totals count them); the model's own
    casts it retargeted are, and so are the fp32 checks a decomposed program keeps of
    the model's casts that open a region (``fx16.analysis.explicit_fp32``).
    """
    graphs = [
        (name, module)
        for name, module in ep.graph_module.named_modules()
        if isinstance(module, GraphModule)
    ]
    nodes = [
        (body, n)
        for body, module in graphs
        for n in module.graph.nodes
        if n.op in ("placeholder", "call_function")
        and (not is_inserted(n) or n.meta[INSERTED] == WHY_RETARGETED)
    ]
    int16_ran = any(INT_PRECISION in n.meta for _, n in nodes)
    program = Program.of(ep)
    inputs = {p.name: ("input", "") for p in program.user_input_placeholders()}
    inputs |= {
        slot.placeholder.name: (
            _SLOT_KINDS.get(slot.kind, "constant"),
            slot.target.rpartition(".")[0],
        )
        for slot in program.state_slots()
    }
    rows = [
        _row(n, "float", n.meta.get(PRECISION), body, inputs)
        for body, n in nodes
        if PRECISION in n.meta or getattr(node_dtype(n), "is_floating_point", False)
    ]
    listed = {row.node for row in rows}
    rows += [row for body, module in graphs for row in _island_rows(module, body, listed)]
    rows += [
        _row(n, "int", n.meta.get(INT_PRECISION), body, inputs)
        for body, n in nodes
        if INT_PRECISION in n.meta or (int16_ran and node_dtype(n) in WIDE_INT_DTYPES)
    ]
    return rows


def build_report(
    ep: ExportedProgram, before: ProgramStats | None, accuracy: AccuracySearch | None = None
) -> CastReport:
    """The report of a cast of ``ep``, built when first read; ``before``: the program's
    figures before it (None: not recorded; the weight bytes before then follow from the
    decisions, and the model's casts the cleanup removed are not known)."""
    return CastReport(Pending(ep, before), accuracy)


def totals(ep: ExportedProgram, before: ProgramStats | None) -> Totals:
    """The figures of ``ep`` after its cast, beside ``before``'s."""
    after = program_stats(ep)
    model_casts = after.casts - after.inserted_casts
    return Totals(
        weight_bytes_before=before.weight_bytes if before else _bytes_before(ep),
        weight_bytes_after=after.weight_bytes,
        casts_before=before.casts if before else model_casts,
        casts_after=after.casts,
        casts_inserted=after.inserted_casts,
        model_casts_removed=max(before.casts - model_casts, 0) if before else None,
        float_ops=after.float_ops,
        float_ops_16bit=after.ops_in(torch.float16) + after.ops_in(torch.bfloat16),
        product_flops=after.product_flops,
        product_flops_16bit=after.product_flops_16bit,
        cast_bytes=after.cast_bytes,
        fp32_weight_bytes=after.fp32_weight_bytes,
    )


def _bytes_before(ep: ExportedProgram) -> int:
    """The state's bytes before a cast: each tensor narrowed from fp32 took twice its size."""
    total, program = program_stats(ep).weight_bytes, Program.of(ep)
    for slot in program.state_slots():
        tensor = program.state_tensor(slot.target)
        decision = slot.placeholder.meta.get(PRECISION)
        if decision is not None and decision.narrowed and isinstance(tensor, torch.Tensor):
            total += tensor.numel() * tensor.element_size()
    return total


def format_rows(rows: list[Row]) -> str:
    """A table: node (full name), module, op, dtype, rule, what fp32 costs where it is
    kept, and the reason (with ranges or detail); columns as wide as their longest entry."""
    columns = [
        ("node", [row.node for row in rows]),
        ("module", [row.module or "-" for row in rows]),
        ("op", [row.op for row in rows]),
        ("dtype", [row.dtype for row in rows]),
        ("rule", [row.rule for row in rows]),
        ("fp32-cost", [row.cost() or "-" for row in rows]),
    ]
    widths = [max([len(title), *map(len, cells)]) for title, cells in columns]
    lines = [" ".join(f"{title:{w}}" for (title, _), w in zip(columns, widths)) + " why"]
    for index, row in enumerate(rows):
        cells = " ".join(f"{cells[index]:{w}}" for (_, cells), w in zip(columns, widths))
        skipped = f" (no cast back: {row.cast_back_skipped})" if row.cast_back_skipped else ""
        made = f" (stabilized: {row.stabilized})" if row.stabilized else ""
        why = row.reason + (f": {row.detail}" if row.detail else "")
        lines.append(f"{cells} {why}{skipped}{made}")
    return "\n".join(lines)


def report_of(ep: ExportedProgram) -> CastReport | None:
    """The report of the cast of ``ep``: the one an fx16 cast function stored, or, for a
    program cast by fx16's passes in a pipeline of its own (``PassManager``), one built
    now from the decisions its nodes carry. None for a program fx16 did not cast."""
    stored = ep.graph_module.meta.get(REPORT_KEY)
    if stored is not None:
        return stored
    decided = any(
        PRECISION in node.meta or INT_PRECISION in node.meta
        for module in ep.graph_module.modules()
        if isinstance(module, GraphModule)
        for node in module.graph.nodes
    )
    return build_report(ep, ep.graph_module.meta.get(BEFORE_KEY)) if decided else None
