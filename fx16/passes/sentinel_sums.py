"""SentinelSumsPass: a mask's sentinel absorbs what it is added to in fp16 as in fp32.

``scores + mask`` with a ``finfo(float32).min`` mask gives, in fp32, the mask's own
value wherever the mask holds it: -3.4e38 absorbs any score. fp16 carries the mask
saturated to -65504 (``fx16.ops.numerics``), which absorbs only scores smaller than
half an ulp of its maximum (16): a score of -20 takes the sum to -inf, one of 2,500
leaves -63004. A row masked whole (a padded query) then differs: fp32's softmax gives
it equal weights, fp16's gives nan (every element -inf; 0 * nan then carries the nan
into every row the next attention mixes) or the scores' own softmax. So, where
calibration saw one operand of an ``add`` hold an infinity-like sentinel and the other
reach that half ulp over the overflow margin (or go unobserved), the sum becomes

    scores + mask  ->  where(mask + scores * 0 <= -1e38, mask, scores + mask)

In fp32 it is the same tensor bit for bit: the sum already is the mask there, except
where a score is inf or nan (the sum is then inf or nan), which ``scores * 0`` (nan
there, 0 elsewhere) leaves to the sum. In 16-bit the comparison's -1e38 saturates as the
mask's does, so a masked element is the saturated mask whatever its finite score.
Cost: a product, a sum, a comparison and a select on the sum's elements. bf16 carries
sentinels at fp32's range, absorbing as fp32 does: fp16 only.

Reads: what calibration observed (``fx16.meta.holds_sentinel``, ``observed_max_abs``).
Writes: the ``mul``, ``add``, ``le`` and ``where`` nodes after each such sum, the sum's
readers moved to the ``where``, which holds the sum's observations (the same values) and
``meta["fx16.stabilized"]`` (``sentinel_sum`` and why: the report lists it).
"""

import math

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis, share_observations
from fx16.analysis.facts import Facts
from fx16.contracts import require
from fx16.ops.numerics import INF_LIKE, largest
from fx16.passes.stable_rewrites.matching import Builder
from fx16.program.node_ids import assign_ids
from fx16.program.nodes import is_float_tensor, node_val
from fx16.program.subgraphs import nested_graph_modules

aten = torch.ops.aten
RULE = "sentinel_sum"


def absorbed_below(low: torch.dtype) -> float:
    """The magnitude from which an addend is no longer absorbed by ``low``'s saturated
    sentinel: half an ulp of its largest value (fp16: 16)."""
    return torch.finfo(low).eps * 2.0 ** math.floor(math.log2(largest(low))) / 2


class SentinelSumsPass(PassBase):
    """Rewrite each sum of a sentinel mask and an addend fp16 would not absorb (see the
    module); ``overflow_margin``: how much larger than calibration's an addend may grow."""

    preserves = (CalibrationAnalysis,)  # the new sum holds the old one's observations

    def __init__(self, low: torch.dtype = torch.float16, overflow_margin: float = 2.0) -> None:
        self.low = low
        self.reach = absorbed_below(low) / overflow_margin

    def requires(self, graph_module: GraphModule) -> None:
        require(graph_module, type(self).__name__, (CalibrationAnalysis,))

    def call(self, graph_module: GraphModule) -> PassResult:
        modified = False
        if self.low == torch.float16 and CalibrationAnalysis.observed(graph_module):
            for module in nested_graph_modules(graph_module):
                found = [node for node in module.graph.nodes if self._unabsorbed(node)]
                for node in found:
                    _keep_the_sentinel(module, node, *_mask_and_addend(node))
                if found and module is not graph_module:
                    module.recompile()  # the root is recompiled by whoever runs the pipeline
                modified |= bool(found)
        if modified:
            Facts.invalidate(graph_module)
            assign_ids(graph_module)
        return PassResult(graph_module, modified)

    def _unabsorbed(self, node: Node) -> bool:
        """A float ``add`` of two tensors (no ``alpha``) exactly one of which held a
        sentinel on calibration, the other reaching ``reach`` there (or unobserved), and
        not guarded already (a program cast before: casting twice equals casting once)."""
        if not (node.op == "call_function" and node.target == aten.add.Tensor):
            return False
        if node.kwargs or len(node.args) != 2 or not is_float_tensor(node_val(node)):
            return False
        if _guarded(node):
            return False
        operands = node.args
        if not all(isinstance(arg, Node) and is_float_tensor(node_val(arg)) for arg in operands):
            return False
        holding = [meta.holds_sentinel(arg) for arg in operands]
        if holding.count(True) != 1:
            return False
        addend = operands[holding.index(False)]
        magnitude = meta.observed_max_abs(addend)
        return magnitude is None or magnitude >= self.reach


def _guarded(total: Node) -> bool:
    """``total`` is read only by the ``where`` this pass made for it (its third operand)."""
    readers = list(total.users)
    if len(readers) != 1 or readers[0].target != aten.where.self:
        return False
    kept = readers[0]
    return (meta.stabilized(kept) or ("",))[0] == RULE and kept.args[2] is total


def _mask_and_addend(total: Node) -> tuple[Node, Node]:
    """The operands of a sum ``_unabsorbed`` accepted, the sentinel's holder first."""
    first, second = total.args[:2]
    return (first, second) if meta.holds_sentinel(first) else (second, first)


def _keep_the_sentinel(module: GraphModule, total: Node, mask: Node, addend: Node) -> None:
    """``where(mask + addend * 0 <= -1e38, mask, total)`` after ``total``, taking over its
    readers. ``addend * 0`` is 0 where the addend is finite and nan where it is inf or
    nan, so only there is the comparison false: fp32's sum is the mask wherever the
    addend is finite and the mask holds the sentinel, and an inf or nan addend makes it
    inf or nan, which the sum keeps."""
    readers = list(total.users)
    make = Builder(module.graph, total.next)  # each with its fake value and total's provenance
    zeroed = make(aten.mul.Tensor, addend, 0.0)
    unless_not_finite = make(aten.add.Tensor, mask, zeroed)
    masked = make(aten.le.Scalar, unless_not_finite, -INF_LIKE)
    kept = make(aten.where.self, masked, mask, total)
    for reader in readers:
        reader.replace_input_with(total, kept)
    share_observations(total, kept)
    share_observations(mask, unless_not_finite)  # the mask's values (nan ignored, as observed)
    largest_addend = meta.observed_max_abs(addend)
    if largest_addend is not None:  # zeros, nan ignored
        zeroed.meta.update({meta.OBSERVED_MAX_ABS: 0.0, meta.OBSERVED_INTERVAL: (0.0, 0.0)})
    seen = "unobserved" if largest_addend is None else f"up to {largest_addend:.3g}"
    kept.meta[meta.STABILIZED] = (
        RULE,
        f"{mask.name}'s -1e38 absorbs {addend.name} ({seen} on calibration) in fp32; "
        "saturated to -65504 it would not, so its masked elements keep the mask's value",
    )
