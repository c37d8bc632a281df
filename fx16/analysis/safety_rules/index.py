"""The safety rule for a float value that decides an index: it stays fp32.
``fx16.analysis.fp32_rules`` runs them in order."""

from dataclasses import dataclass

from torch.fx import Node

from fx16 import meta
from fx16.analysis.safety_rule import RuleContext
from fx16.analysis.unsafe_index import UnsafeIndexAnalysis
from fx16.decisions import Reason
from fx16.ops.int_ops import SELECTION_OPS


@dataclass(frozen=True)
class UnsafeIndexRule:
    """A float value that decides an index (positions turned into bucket ids) stays
    fp32: rounding would pick another element. A selection (topk, argmax) is not
    one: its indices are valid whatever it compares (see RouterRule). Reads
    ``meta["fx16.unsafe_index"]``.

    Before: ``(log(p.float() / 8) * 4).long()`` picks bucket 17 in fp32 and 16 in fp16.
    After: the log, the scale and the floor stay fp32; the embedding they index runs
    16-bit. Costs: the elementwise chain's bytes, no product FLOPs."""

    needs = (UnsafeIndexAnalysis,)
    markers = (meta.UNSAFE_INDEX,)
    reason = Reason.UNSAFE_INDEX

    def applies(self, node: Node, context: RuleContext) -> str | None:
        marked = meta.flows_into_index(node)
        return "" if marked and node.target not in SELECTION_OPS else None
