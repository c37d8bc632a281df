"""The decision report: every precision decision fx16 recorded, as rows, JSON or a table."""

import json
from dataclasses import asdict, dataclass

import torch
from torch.export import ExportedProgram

from fx16.analysis.value_range import ValueRangeAnalysis
from fx16.decisions import INT_PRECISION, PRECISION, Decision


@dataclass(frozen=True)
class Row:
    node: str
    op: str
    kind: str  # "float" or "int"
    dtype: str
    narrowed: bool
    reason: str
    detail: str


def _op_name(node) -> str:
    return node.name if node.op == "placeholder" else str(node.target).removeprefix("aten.")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decision_rows(ep: ExportedProgram) -> list[Row]:
    """One row per node fx16 decided, in graph order (floating point, then integer)."""
    rows = []
    for kind, key in (("float", PRECISION), ("int", INT_PRECISION)):
        for node in ep.graph_module.graph.nodes:
            decision: Decision | None = node.meta.get(key)
            if decision is None:
                continue
            detail = decision.detail
            if not detail and kind == "int" and node.meta.get(ValueRangeAnalysis.META_KEY):
                detail = str(node.meta[ValueRangeAnalysis.META_KEY])
            rows.append(
                Row(
                    node.name,
                    _op_name(node),
                    kind,
                    _dtype_name(decision.dtype),
                    decision.narrowed,
                    decision.reason.value,
                    detail,
                )
            )
    return rows


def report_json(ep: ExportedProgram) -> str:
    return json.dumps([asdict(row) for row in decision_rows(ep)], indent=2)


def format_rows(rows: list[Row]) -> str:
    """A fixed-width table: node, op, dtype, reason (and the ranges or detail)."""
    lines = [f"{'node':24} {'op':28} {'dtype':8} why"]
    for row in rows:
        why = row.reason + (f": {row.detail}" if row.detail else "")
        lines.append(f"{row.node[:24]:24} {row.op[:28]:28} {row.dtype:8} {why}")
    return "\n".join(lines)
