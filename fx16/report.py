"""The decision report: what fx16 did to a program, node by node and in total.

Every public cast function stores a ``CastReport`` in
``ep.graph_module.meta["fx16.report"]`` (it lives with the program object; it is
not saved in ``.pt2`` files, so write ``to_json()`` where you need it kept).
"""

import json
from dataclasses import asdict, dataclass, replace

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node

from fx16.analysis.explicit_fp32 import islands
from fx16.analysis.value_range import ValueRangeAnalysis
from fx16.budget import AccuracySearch
from fx16.casts import INSERTED, WHY_RETARGETED, is_inserted
from fx16.decisions import INT_PRECISION, PRECISION, Decision, Reason
from fx16.nodes import node_dtype, op_label
from fx16.ops import WIDE_INT_DTYPES
from fx16.stats import ProgramStats, program_stats

REPORT_KEY = "fx16.report"
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


@dataclass(frozen=True)
class Totals:
    weight_bytes_before: int
    weight_bytes_after: int
    casts_before: int
    casts_after: int
    casts_inserted: int
    model_casts_removed: int
    float_ops: int
    float_ops_16bit: int

    @property
    def share_16bit(self) -> float:
        return self.float_ops_16bit / self.float_ops if self.float_ops else 1.0


@dataclass(frozen=True)
class CastReport:
    rows: list[Row]
    totals: Totals
    accuracy: AccuracySearch | None = None  # set when the cast had an accuracy budget

    def kept_wide(self) -> list[Row]:
        return [row for row in self.rows if not row.narrowed]

    def to_json(self) -> str:
        totals = {**asdict(self.totals), "share_16bit": round(self.totals.share_16bit, 4)}
        document = {"totals": totals, "nodes": [asdict(r) for r in self.rows]}
        if self.accuracy is not None:
            document["accuracy"] = {**asdict(self.accuracy), "met": self.accuracy.met}
        return json.dumps(document, indent=2)

    def table(self, rows: list[Row] | None = None) -> str:
        """A fixed-width table of ``rows`` (default: every row), then the totals."""
        t = self.totals
        lines = [format_rows(self.rows if rows is None else rows), ""]
        lines.append(f"weight bytes: {t.weight_bytes_before} -> {t.weight_bytes_after}")
        lines.append(
            f"casts: {t.casts_before} -> {t.casts_after} "
            f"({t.casts_inserted} inserted by fx16, {t.model_casts_removed} of the model's removed)"
        )
        lines.append(
            f"float ops in 16-bit: {t.float_ops_16bit} of {t.float_ops} ({t.share_16bit:.0%})"
        )
        if self.accuracy is not None:
            a = self.accuracy
            lines.append(
                f"accuracy: error {a.error:.3g} (budget {a.budget:.3g}) after {a.rounds} round(s), "
                f"{a.evaluations} program evaluations, {len(a.fp32_nodes)} node(s) back in fp32"
            )
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _row(node: Node, kind: str, decision: Decision | None, body: str = "") -> Row:
    name = f"{body}.{node.name}" if body else node.name
    if decision is None:
        dtype = node_dtype(node)
        return Row(
            name,
            op_label(node),
            kind,
            _dtype_name(dtype),
            dtype == torch.float16,
            "left_as_is",
            LEFT_AS_IS,
            "",
        )
    if not decision.detail and kind == "int" and node.meta.get(ValueRangeAnalysis.META_KEY):
        decision = replace(decision, detail=str(node.meta[ValueRangeAnalysis.META_KEY]))
    return _decision_row(name, op_label(node), kind, decision)


def _decision_row(name: str, op: str, kind: str, decision: Decision) -> Row:
    return Row(
        name,
        op,
        kind,
        _dtype_name(decision.dtype),
        decision.narrowed,
        decision.reason.name.lower(),
        decision.reason.value,
        decision.detail,
    )


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
    rows = [
        _row(n, "float", n.meta.get(PRECISION), body)
        for body, n in nodes
        if PRECISION in n.meta or getattr(node_dtype(n), "is_floating_point", False)
    ]
    listed = {row.node for row in rows}
    rows += [row for body, module in graphs for row in _island_rows(module, body, listed)]
    rows += [
        _row(n, "int", n.meta.get(INT_PRECISION), body)
        for body, n in nodes
        if INT_PRECISION in n.meta or (int16_ran and node_dtype(n) in WIDE_INT_DTYPES)
    ]
    return rows


def build_report(
    ep: ExportedProgram, before: ProgramStats, accuracy: AccuracySearch | None = None
) -> CastReport:
    after = program_stats(ep)
    float_ops = after.float_ops
    return CastReport(
        decision_rows(ep),
        Totals(
            weight_bytes_before=before.weight_bytes,
            weight_bytes_after=after.weight_bytes,
            casts_before=before.casts,
            casts_after=after.casts,
            casts_inserted=after.inserted_casts,
            model_casts_removed=max(before.casts - (after.casts - after.inserted_casts), 0),
            float_ops=float_ops,
            float_ops_16bit=after.ops_in(torch.float16) + after.ops_in(torch.bfloat16),
        ),
        accuracy,
    )


def format_rows(rows: list[Row]) -> str:
    """A fixed-width table: node, op, dtype, rule and reason (with ranges or detail)."""
    lines = [f"{'node':24} {'op':28} {'dtype':8} {'rule':20} why"]
    for row in rows:
        why = row.reason + (f": {row.detail}" if row.detail else "")
        lines.append(f"{row.node[:24]:24} {row.op[:28]:28} {row.dtype:8} {row.rule[:20]:20} {why}")
    return "\n".join(lines)


def report_of(ep: ExportedProgram) -> CastReport | None:
    """The report the last fx16 cast stored on ``ep``, if any."""
    return ep.graph_module.meta.get(REPORT_KEY)
