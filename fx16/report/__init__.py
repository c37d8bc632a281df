"""The decision report: what fx16 did to a program, node by node and in total.

Every public cast function stores a ``CastReport`` in
``ep.graph_module.meta["fx16.report"]``. It lives with the program object; a ``.pt2``
file keeps each node's decision, the facts the report reads and the report's provenance
(``fx16.report.saved``), from which ``report_of`` rebuilds the report of a loaded
program, the same to the letter of its JSON.
"""

import copy
import json
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx16.accuracy.search import AccuracySearch
from fx16.decisions import INT_PRECISION, PRECISION, reasons
from fx16.program.stats import BEFORE_KEY, ProgramStats
from fx16.report.rows import (
    NEVER_INT16_CANDIDATES,
    Row,
    Totals,
    decision_rows,
    human,
    layer_of,
    totals,
)
from fx16.report.saved import json_ready, kept_accuracy, kept_report, restore_decisions

REPORT_KEY = "fx16.report"


class Pending:
    """A report's rows and totals, built from the program when first read.

    A cast does not pay for a report nobody reads (building it costs about as much as
    the walk that decides). It shows the program as it is when first read: read it
    before rewriting the graph further. The stored report refers to its program weakly:
    it lives on the program's graph module, which torch may keep after the caller drops
    the program (the graph it traced last), and a strong reference from there would keep
    every weight alive. ``report_of`` hands out a report that holds the program until
    the report is built (``holding``)."""

    def __init__(self, ep: ExportedProgram, before: ProgramStats | None, margin: float) -> None:
        self.program = weakref.ref(ep)
        self.before, self.margin = before, margin
        self.built: tuple[list[Row], Totals] | None = None

    def __call__(self, ep: ExportedProgram | None = None) -> tuple[list[Row], Totals]:
        if self.built is None:
            ep = ep if ep is not None else self.program()
            if ep is None:
                raise ReferenceError(
                    "fx16: the program this report describes was freed before the report "
                    "was first read; read report_of(ep) while ep lives"
                )
            self.built = decision_rows(ep), totals(ep, self.before, self.margin)
        return self.built

    def holding(self, ep: ExportedProgram) -> "_Held":
        """This source, holding ``ep`` until it is built (one build for every holder)."""
        return _Held(self, ep)

    def __deepcopy__(self, memo: dict) -> "Pending":
        """A deep copy of the program gets a report of the copy."""
        copied, ep = copy.copy(self), self.program()
        if ep is not None:
            copied.program = weakref.ref(memo.get(id(ep), ep))
        copied.before = copy.deepcopy(self.before, memo)
        copied.built = copy.deepcopy(self.built, memo)
        return copied


class _Held:
    """A ``Pending`` with its program held: what a report read by ``report_of`` builds
    from, so that ``report_of(fx16.cast_fp32_to_fp16(export(...))).rows`` works."""

    def __init__(self, pending: Pending, ep: ExportedProgram) -> None:
        self.pending, self.ep = pending, ep

    def __call__(self) -> tuple[list[Row], Totals]:
        built = self.pending(self.ep)
        self.ep = None  # built: the program is no longer needed
        return built


@dataclass(frozen=True)
class CastReport:
    source: "Pending | _Held | tuple[list[Row], Totals]" = field(repr=False)
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
        return source() if isinstance(source, (Pending, _Held)) else source

    def kept_wide(self) -> list[Row]:
        return [row for row in self.rows if not row.narrowed]

    def explained(self) -> list[Row]:
        """The rows a reader asks "why" about: values kept wide, and those computed in
        bf16 for range in an fp16 program (``range_fallback="bf16"``), except integers
        that were never int16 candidates (outside the castable set: constant-foldable,
        not integer arithmetic, index computations; or undecided). A model has many such
        integers (positions, masks, shapes) and they would bury the float rows."""
        return [
            row
            for row in self.rows
            if (not row.narrowed or _fallen_back(row))
            and (row.kind == "float" or row.rule not in NEVER_INT16_CANDIDATES)
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
            f"{human(t.product_flops)} per call"
            if t.product_flops
            else "matmul/conv/attention FLOPs: none in this program",
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
        lines += [f"range: scale domain {domain}" for domain in t.scale_domains]
        if self.accuracy is not None:
            lines.append(self.accuracy.describe())
        if t.envelope is not None:
            lines += [f"envelope: {line}" for line in t.envelope.lines()]
        return lines

    def by_layer(self) -> list[str]:
        """One line per layer (module path up to its index: "model.layers.3"): the
        share of its matmul/conv/attention FLOPs in 16-bit, how many of its float
        values are 16-bit, fp32, and carried at a scale, and the rules that kept values
        fp32."""
        groups = self.layers()
        width = max((len(name) for name in groups), default=5)
        lines = [
            f"{'layer':{width}} {'FLOPs 16-bit':>12} {'16-bit':>7} {'fp32':>5} {'scaled':>6}  "
            "rules keeping float values fp32"
        ]
        for name, rows in groups.items():
            wide = [row for row in rows if not row.narrowed]
            scaled = sum(bool(row.scale_exponent) for row in rows)
            rules = Counter(row.rule for row in wide)
            why = ", ".join(f"{rule} x{count}" for rule, count in rules.items()) or "-"
            lines.append(
                f"{name:{width}} {layer_flop_share(rows):>12} {len(rows) - len(wide):>7} "
                f"{len(wide):>5} {scaled:>6}  {why}"
            )
        return lines

    def layers(self) -> dict[str, list[Row]]:
        """The float rows by layer, in graph order."""
        groups: dict[str, list[Row]] = {}
        for row in self.rows:
            if row.kind == "float":
                groups.setdefault(layer_of(row.module), []).append(row)
        return groups


def _fallen_back(row: Row) -> bool:
    """A value computed or stored in bf16 for range (``range_fallback="bf16"``), not
    because it fits."""
    return row.kind == "float" and row.dtype == "bfloat16" and row.rule in _FALLBACK_RULES


# the causes a range fallback keeps on what it moves to bf16, as rows name them
_FALLBACK_RULES = frozenset(reason.name.lower() for reason in reasons(bf16_fallback=True))


def layer_flop_share(rows: list[Row]) -> str:
    """The share of the rows' matmul/conv/attention FLOPs in 16-bit ("-" without any)."""
    total = sum(row.flops for row in rows if row.product)
    low = sum(row.flops for row in rows if row.product and row.narrowed)
    return f"{low / total:.0%}" if total else "-"


def build_report(
    ep: ExportedProgram,
    before: ProgramStats | None,
    accuracy: AccuracySearch | None = None,
    margin: float = 2.0,
) -> CastReport:
    """The report of a cast of ``ep``, built when first read; ``before``: the program's
    figures before it (None: not recorded; the weight bytes before then follow from the
    decisions, and the model's casts the cleanup removed are not known); ``margin``:
    the overflow margin the cast was made with (its envelope states it)."""
    return CastReport(Pending(ep, before, margin), accuracy)


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
        lines.append(f"{cells} {row.why()}{skipped}{made}")
    return "\n".join(lines)


def report_of(ep: ExportedProgram) -> CastReport | None:
    """The report of the cast of ``ep``: the one an fx16 cast function stored; for a cast
    program saved and loaded, one rebuilt from the decisions it kept; for a program cast
    by fx16's passes in a pipeline of its own (``PassManager``), one built now from the
    decisions its nodes carry. None for a program fx16 did not cast."""
    report = ep.graph_module.meta.get(REPORT_KEY)
    if report is None:
        if restore_decisions(ep.graph_module):  # a cast program, saved and loaded
            kept = kept_report(ep.graph_module)
            report = replace(
                build_report(
                    ep,
                    ep.graph_module.meta.get(BEFORE_KEY),
                    kept_accuracy(ep.graph_module),
                    kept.get("margin", 2.0),
                ),
                provenance=kept.get("provenance", {}),
            )
            ep.graph_module.meta[REPORT_KEY] = report
            return report_of(ep)
        decided = any(
            PRECISION in node.meta or INT_PRECISION in node.meta
            for module in ep.graph_module.modules()
            if isinstance(module, GraphModule)
            for node in module.graph.nodes
        )
        if not decided:
            return None
        report = build_report(ep, ep.graph_module.meta.get(BEFORE_KEY))
    if isinstance(report.source, Pending):  # the reader's report holds ep until built
        return replace(report, source=report.source.holding(ep))
    return report
