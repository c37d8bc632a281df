"""A cast program's decisions, kept through ``torch.export.save`` and ``load``.

``torch.export.save`` keeps an op node's ``meta["custom"]`` and the program graph
module's (JSON values) and drops the rest of the meta. A cast keeps there, for every op
node, its decision as text (``fx16_decision``: the rule, the evidence and what the step
adds, for ``fx16.diagnose`` and a reader of the graph) and as data (``fx16_precision``:
dtype, reason and detail by meta key); in the graph module's, what no op node can carry:
the placeholders' decisions (a placeholder's custom meta is not saved), the verdicts on
the model's own fp32 regions (``fx16.analysis.explicit_fp32``), the report's provenance
and overflow margin. ``restore_decisions`` gives a loaded program all of them back, from
which ``fx16.report.report_of`` builds its report (the calibration's observations and
the accuracy search are not kept: their columns are empty).
"""

import torch
from torch.fx import GraphModule, Node

from fx16.analysis.explicit_fp32 import ExplicitFp32Analysis, Island
from fx16.decisions import INT_PRECISION, PRECISION, Decision, Reason, decision
from fx16.meta import SAVED_REPORT
from fx16.program.node_ids import CUSTOM, graph_modules
from fx16.program.nodes import dtype_name

DECISION = "fx16_decision"  # the rule and reason of a node's precision, as text
SAVED = "fx16_precision"  # {meta key: [dtype, reason name, detail]}
REPORT = SAVED_REPORT  # the graph's: {"provenance": ..., "margin": ...}
_KEYS = (PRECISION, INT_PRECISION)


def keep_decisions(root: GraphModule, explained, provenance: dict, margin: float) -> None:
    """Copy each op node's decision into its custom meta, as text (``explained(node)``)
    and as data, and the placeholders' decisions, the regions' verdicts, the report's
    ``provenance`` and ``margin`` into ``root``'s."""
    placeholders, regions = {}, {}
    for prefix, module in graph_modules(root):
        for node in module.graph.nodes:
            if node.op == "placeholder":
                if data := _as_data(node):
                    placeholders[prefix + node.name] = data
            elif node.op == "call_function":
                kept = {**node.meta.get(CUSTOM, {})}  # a new dict: a snapshot shares the old
                if text := explained(node):
                    kept[DECISION] = text
                if data := _as_data(node):
                    kept[SAVED] = data
                if kept:
                    node.meta[CUSTOM] = kept
        verdicts = module.meta.get(ExplicitFp32Analysis.META_KEY, [])
        if verdicts:
            regions[prefix] = [_island_data(island) for island in verdicts]
    report = {
        "provenance": provenance,
        "margin": margin,
        "placeholders": placeholders,
        "regions": regions,
    }
    root.meta[CUSTOM] = {**root.meta.get(CUSTOM, {}), REPORT: report}


def _as_data(node: Node) -> dict:
    return {
        key: [dtype_name(made.dtype), made.reason.name, made.detail]
        for key in _KEYS
        if isinstance(made := node.meta.get(key), Decision)
    }


def _island_data(island: Island) -> list:
    return [
        island.opening,
        island.op,
        island.keep,
        dtype_name(island.dtype),
        island.why,
        sorted(island.members),
    ]


def kept_decision(node: Node) -> str:
    """The decision ``keep_decisions`` stored on ``node`` as text ("" if none)."""
    return (node.meta.get(CUSTOM) or {}).get(DECISION, "")


def kept_report(root: GraphModule) -> dict:
    """The provenance and margin ``keep_decisions`` stored on ``root`` ({} if none)."""
    return (root.meta.get(CUSTOM) or {}).get(REPORT, {})


def restore_decisions(root: GraphModule) -> bool:
    """Give every node of ``root`` (a loaded cast program) that has no decision the one
    kept for it, and each graph its regions' verdicts. Returns whether any was kept."""
    kept = kept_report(root)
    found = bool(kept)
    for prefix, module in graph_modules(root):
        for node in module.graph.nodes:
            if node.op == "placeholder":
                saved = kept.get("placeholders", {}).get(prefix + node.name, {})
            else:
                saved = (node.meta.get(CUSTOM) or {}).get(SAVED, {})
            for key, (dtype, reason, detail) in saved.items():
                found = True
                if key not in node.meta:
                    node.meta[key] = decision(getattr(torch, dtype), Reason[reason], detail)
        regions = kept.get("regions", {}).get(prefix)
        if regions and ExplicitFp32Analysis.META_KEY not in module.meta:
            module.meta[ExplicitFp32Analysis.META_KEY] = [
                Island(opening, op, keep, getattr(torch, dtype), why, frozenset(members))
                for opening, op, keep, dtype, why, members in regions
            ]
    return found
