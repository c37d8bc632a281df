"""What one question of ``VerdictCheckAnalysis`` holds: the nodes it would return to
16-bit, grouped by kind across layers, which of them only it keeps, whether it is cheap
enough to hold unasked, and the values left kept for ops whose verdicts were dropped.

Reads: ``meta["fx16.fp32_rule"]``, ``meta["fx16.conditioning"]``, the island verdicts
(ExplicitFp32Analysis). Writes nothing.
"""

import re
from dataclasses import dataclass, field

from torch.fx import GraphModule, Node

from fx16 import meta
from fx16.analysis.explicit_fp32 import islands
from fx16.analysis.fp32_rules import fp32_rule
from fx16.decisions import Reason
from fx16.program.cost import elements, is_product
from fx16.program.nodes import node_module_path, op_label

# A question whose nodes compute at most this share of the program's elementwise work
# (every op's elements, the products' FLOPs left out) is cheap, and holds unasked.
CHEAP_SHARE = 0.01


@dataclass
class Question:
    """One question: ``nodes``, kept in fp32 by a rule of one of ``reasons`` (None: by an
    island of the model's, opened at the ``islands``' nodes)."""

    label: str
    reasons: frozenset
    nodes: set[Node] = field(default_factory=set)
    cost: int = 0
    islands: list[tuple[GraphModule, Node]] = field(default_factory=list)


def orphaned_chains(findings: list, wide: set[Node], returned: set[Node]) -> Question | None:
    """The values kept in fp32 only to feed ill-conditioned ops whose verdicts were
    dropped (a rotary embedding's angles, once its cos and sin compute in 16-bit): what
    they feed rounds them to 16-bit now, so one more question asks whether their fp32
    still pays. None where there are none."""
    dropped = [f for f in findings if f.seed in returned]
    needed = {n for f in findings if f.seed not in returned for n in (f.seed, *f.chain)}
    nodes = {
        node
        for finding in dropped
        for node in finding.chain
        if node in wide
        and node not in needed
        and (rule := fp32_rule(node)) is not None
        and rule.reason is Reason.ILL_CONDITIONED
    }
    if not nodes:
        return None
    fed = sorted(
        {f"{op_label(f.seed)} at {pattern(f.seed)}" for f in dropped if nodes & set(f.chain)}
    )
    label = f"ill_conditioned inputs of {', '.join(fed)}"
    return Question(label, frozenset({Reason.ILL_CONDITIONED}), nodes)


def cheap_work(modules: list[GraphModule]) -> float:
    """``CHEAP_SHARE`` of the elementwise work of ``modules``: the elements every op
    produces, the products (whose FLOPs dwarf it) left out."""
    nodes = (n for m in modules for n in m.graph.nodes if n.op == "call_function")
    return CHEAP_SHARE * sum(elements(n) for n in nodes if not is_product(n))


def is_cheap(nodes: set[Node], work: float) -> bool:
    """Whether keeping ``nodes`` in fp32 costs nothing a device notices: no product among
    them (one runs 8-16x slower in fp32), and the elements they produce within ``work``."""
    return not any(is_product(n) for n in nodes) and sum(map(elements, nodes)) <= work


def live_islands(module: GraphModule, by_name: dict[str, Node] | None = None) -> list:
    """The island verdicts of ``module`` whose opening is in its graph: an earlier
    cast's verdict on a region its cleanup removed stays only for the report."""
    names = by_name if by_name is not None else {n.name for n in module.graph.nodes}
    return [island for island in islands(module) if island.opening in names]


def findings_of(modules: list[GraphModule]) -> list:
    found = (meta.conditioning_finding(node) for module in modules for node in module.graph.nodes)
    return [finding for finding in found if finding is not None]


def droppable(group: Question, findings: list) -> set[Node]:
    """The nodes of ``group`` that only its question keeps in fp32: kept for one of its
    reasons, and not for a conditioning finding outside it."""
    needed = set()
    for finding in findings:
        if finding.seed not in group.nodes:
            needed.update(finding.chain)
            needed.add(finding.seed)
    return {
        node
        for node in group.nodes - needed
        if (fp32_rule(node).reason if fp32_rule(node) else None) in group.reasons
    }


def pattern(node: Node) -> str:
    """The node's module path with its layer indices as ``*``: the same place in every layer."""
    path = node_module_path(node) or "(no module)"
    return re.sub(r"(?:^|(?<=\.))\d+(?=\.|$)", "*", path)
