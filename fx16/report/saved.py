"""A cast program's decisions, kept through ``torch.export.save`` and ``load``.

``torch.export.save`` keeps an op node's ``meta["custom"]`` and the program graph
module's (JSON values) and drops the rest of the meta. A cast keeps there, for every op
node, its decision as text (``fx16_decision``: the rule, the evidence and what the step
adds, for ``fx16.diagnose`` and a reader of the graph) and as data (``fx16_precision``:
dtype, reason and detail by meta key); in the graph module's, what no op node can carry:
the placeholders' decisions (a placeholder's custom meta is not saved), the verdicts on
the model's own fp32 regions (``fx16.analysis.explicit_fp32``), the report's provenance
and overflow margin; and the facts every reader of a cast reads (``FACTS``: a value's
scale exponent, what calibration observed, the casts fx16 inserted, the rewrites' and
the plan's notes; the figures before the cast, how calibration went, the scale domains
and the accuracy search). ``restore_decisions`` gives a loaded program all of them back,
so ``fx16.report.report_of``, ``fx16.diagnose`` and ``fx16 inspect`` read a loaded cast
program as they read the one in memory.
"""

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch
from torch.fx import GraphModule, Node

from fx16 import meta
from fx16.accuracy.search import AccuracySearch
from fx16.analysis.conditioning import Finding
from fx16.analysis.explicit_fp32 import ExplicitFp32Analysis, Island
from fx16.analysis.intervals import Source, ValueRange
from fx16.analysis.scale_domains import Domain
from fx16.decisions import INT_PRECISION, PRECISION, Decision, Reason, decision
from fx16.meta import SAVED_REPORT
from fx16.plan.steps import Planned
from fx16.program.casts import INSERTED
from fx16.program.node_ids import CUSTOM, graph_modules
from fx16.program.nodes import dtype_name
from fx16.program.stats import BEFORE_KEY, ProgramStats

DECISION = "fx16_decision"  # the rule and reason of a node's precision, as text
SAVED = "fx16_precision"  # {meta key: [dtype, reason name, detail]}
REPORT = SAVED_REPORT  # the graph's: {"provenance": ..., "margin": ...}
_KEYS = (PRECISION, INT_PRECISION)


def keep_decisions(
    root: GraphModule,
    explained,
    provenance: dict,
    margin: float,
    accuracy: AccuracySearch | None = None,
) -> None:
    """Copy each op node's decision into its custom meta, as text (``explained(node)``)
    and as data, and the placeholders' decisions, the regions' verdicts, the report's
    ``provenance``, ``margin`` and ``accuracy`` search, and every node's ``FACTS`` into
    ``root``'s."""
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
    graph_facts = _graph_facts(root)
    facts = graph_facts.pop("facts")  # JSON-ready already, node by node
    report = {
        "provenance": provenance,
        "margin": margin,
        "placeholders": placeholders,
        "regions": regions,
        **graph_facts,
        "accuracy": asdict(accuracy) if accuracy is not None else None,
    }
    report = {**json_ready(report), "facts": facts}
    root.meta[CUSTOM] = {**root.meta.get(CUSTOM, {}), REPORT: report}


def json_ready(value):
    """``value`` with non-finite floats as strings ("inf"), which JSON cannot hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


@dataclass(frozen=True)
class Fact:
    """A node fact kept through save and load: its meta key, as JSON (``dump``; None:
    not kept), and back (``load(saved, node)``)."""

    key: str
    dump: Callable
    load: Callable
    floats: bool = False  # its dump may hold a non-finite float (kept as a string)


def _same(value, node):
    return value


def _floats(value, node):
    return tuple(float(item) for item in value)


_planned_fields = operator.attrgetter(*(field.name for field in fields(Planned)))

# Every node fact a reader of a cast program reads (the report's rows and envelope, the
# diagnosis), by the name it is kept under.
FACTS = {
    "scale": Fact(meta.SCALE_EXPONENT, int, _same),
    "range_scale": Fact(meta.RANGE_SCALE, str, _same),
    "sentinel_fill": Fact(meta.SENTINEL_FILL, str, _same),
    "inserted": Fact(INSERTED, str, _same),
    "observed": Fact(meta.OBSERVED_INTERVAL, list, _floats, floats=True),
    "max_abs": Fact(meta.OBSERVED_MAX_ABS, float, lambda value, node: float(value), True),
    "smallest": Fact(meta.OBSERVED_SMALLEST, float, lambda value, node: float(value), True),
    "stabilized": Fact(meta.STABILIZED, list, lambda value, node: tuple(value)),
    "scaled": Fact(meta.SCALED, str, _same),
    "rounding_cancels": Fact(meta.ROUNDING_CANCELS, str, _same),
    "bounded_below": Fact(meta.BOUNDED_BELOW, str, _same),
    "negligible": Fact(meta.NEGLIGIBLE, str, _same),
    "planned": Fact(
        meta.PLANNED,
        lambda planned: list(_planned_fields(planned)),
        lambda value, node: Planned(value[0], tuple(value[1]), *value[2:]),
    ),
    "proven": Fact(
        meta.PROVEN_RANGE,
        lambda found: (
            [found.low, found.high, found.source.name] if isinstance(found, ValueRange) else None
        ),
        lambda value, node: ValueRange(float(value[0]), float(value[1]), Source[value[2]]),
        floats=True,
    ),
    "kappa": Fact(
        meta.CONDITIONING,
        lambda finding: finding.kappa,
        lambda value, node: Finding(node, float(value), ()),
        floats=True,
    ),
}


# the facts by meta key: a node's meta is matched against them in one set operation
_BY_KEY = {fact.key: (name, fact) for name, fact in FACTS.items()}
_RANK = {fact.key: index for index, fact in enumerate(FACTS.values())}


def _node_facts(node: Node) -> dict:
    """``node``'s facts, JSON-ready, by name (in ``FACTS``' order)."""
    kept, found = {}, node.meta
    for key in sorted(found.keys() & _BY_KEY.keys(), key=_RANK.__getitem__):
        name, fact = _BY_KEY[key]
        value = found[key]
        if value is not None and (dumped := fact.dump(value)) is not None:
            kept[name] = json_ready(dumped) if fact.floats else dumped
    return kept


def _graph_facts(root: GraphModule) -> dict:
    """What the report reads beyond the decisions: every node's facts (by its path and
    name), the figures before the cast, how calibration went, each graph's scale
    domains."""
    facts, domains = {}, {}
    for prefix, module in graph_modules(root):
        for node in module.graph.nodes:
            if kept := _node_facts(node):
                facts[prefix + node.name] = kept
        if found := module.meta.get(meta.SCALE_DOMAINS):
            domains[prefix] = [asdict(domain) for domain in found]
    before = root.meta.get(BEFORE_KEY)
    return {
        "facts": facts,
        "domains": domains,
        "before": asdict(before) if before is not None else None,
        "calibration": root.meta.get(meta.CALIBRATION_STATUS),
    }


def _restore_graph_facts(root: GraphModule, kept: dict) -> None:
    facts = kept.get("facts", {})
    for prefix, module in graph_modules(root):
        for node in module.graph.nodes:
            for name, value in facts.get(prefix + node.name, {}).items():
                fact = FACTS[name]
                if fact.key not in node.meta:
                    node.meta[fact.key] = fact.load(value, node)
        domains = kept.get("domains", {}).get(prefix)
        if domains and meta.SCALE_DOMAINS not in module.meta:
            module.meta[meta.SCALE_DOMAINS] = [
                Domain(**{**domain, **{k: tuple(domain[k]) for k in _TUPLES}}) for domain in domains
            ]
    if kept.get("before") and BEFORE_KEY not in root.meta:
        root.meta[BEFORE_KEY] = ProgramStats(**kept["before"])
    if kept.get("calibration") and meta.CALIBRATION_STATUS not in root.meta:
        root.meta[meta.CALIBRATION_STATUS] = kept["calibration"]


_TUPLES = ("values", "folded", "doors")


def kept_accuracy(root: GraphModule) -> AccuracySearch | None:
    """The accuracy search ``keep_decisions`` stored on ``root`` (None: none ran)."""
    found = kept_report(root).get("accuracy")
    if not found:
        return None
    return AccuracySearch(**{**found, "fp32_nodes": tuple(found["fp32_nodes"])})


def _as_data(node: Node) -> dict:
    found = node.meta
    return {
        key: [_dtype_name(made.dtype), _reason_name(made.reason), made.detail]
        for key in _KEYS
        if key in found and isinstance(made := found[key], Decision)
    }


# A dtype's text and an enum member's name are Python code, asked of every node: each
# is found once.
_dtype_name = functools.cache(dtype_name)


@functools.cache
def _reason_name(reason: Reason) -> str:
    return reason.name


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
    if kept:
        _restore_graph_facts(root, kept)
    return found
