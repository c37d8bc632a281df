"""ExplicitFp32Analysis: which of the model's own fp32 regions stay fp32, and why.

A model written for fp32 or bf16 opens fp32 regions itself: ``x.float()`` before
an RMSNorm's variance, ``softmax(..., dtype=torch.float32)``. In a 16-bit program
each such region is an island of fp32 ops, which a deployment target such as the
Neural Engine runs elsewhere. The analysis decides each island by the policy's
``explicit_fp32``:

- "calibrated" (the default): kept only on evidence that 16-bit would spoil it: an
  op in it whose values, proven or observed on the calibration inputs, exceed the
  16-bit maximum over the overflow margin (an RMSNorm's squares of the "massive
  activations" trained LLMs carry, |x| in the thousands), or stay in the 16-bit
  subnormal range (a variance of tiny activations), or an op the conditioning
  analysis found ill-conditioned; or no calibration input reached it, so nothing
  shows its values fit. Otherwise it is retargeted to 16-bit.
- "keep": every island is kept.
- "retarget": every island is cast to 16-bit, as coreai-opt does; the safety rules
  still keep single overflowing or ill-conditioned ops in fp32.

A cast to fp32 that no precision-sensitive op follows (GPT-2's
``attn_weights.type(value.dtype)``, fp32 only because the model was fp32 at
export) opens no island under any setting. ``torch.autocast(enabled=False)``
regions are not decided here: they always stay fp32.

Reads: ``meta["val"]``, ``meta["fx16.observed_range"]`` (CalibrationAnalysis),
``meta["fx16.ill_conditioned"]`` (ConditioningAnalysis), proven ranges
(``fx16.analysis.float_range``, after ValueRangeAnalysis). Writes:
``node.meta["fx16.explicit_fp32"]``, an ``Island(keep, why, members)``, on each
node that opens a region holding a precision-sensitive op (a region follows its
values into the bodies of higher-order ops and out of them, ``fx16.program.boundaries``;
its members are the ops in the opening's own graph, its evidence all of them): a cast to fp32, an
``_assert_tensor_metadata`` of fp32 (all that ``run_decompositions`` leaves of a
no-op ``x.float()``), an op given ``dtype=torch.float32``;
and in each graph's ``graph_module.meta["fx16.explicit_fp32"]`` the list of its
verdicts (the report reads them there: cleanup may remove a retargeted cast).
"""

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.facts import Facts
from fx16.analysis.float_range import FloatRanges
from fx16.analysis.islands import asserted_dtype, is_sensitive, island_region
from fx16.contracts import Analysis
from fx16.meta import island_verdict
from fx16.ops.numerics import largest, smallest_normal
from fx16.ops.tables import ASSERT_METADATA_OPS, CAST_OPS, CREATION_OPS, per_op
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.program.casts import cast_dtype, is_cast
from fx16.program.nodes import FLOAT_DTYPES, node_dtype, node_val, op_label, requested_dtypes

FP32 = torch.float32


@dataclass(frozen=True)
class Island:
    """The verdict on one region the model opens at node ``opening`` (op ``op``):
    ``keep`` it in fp32 or make it ``dtype``, ``why`` (for the report), and the
    names of the ops it holds (``members``)."""

    opening: str
    op: str
    keep: bool
    dtype: torch.dtype
    why: str
    members: frozenset[str]


class ExplicitFp32Analysis(Analysis):
    """Decide every fp32 region the model opens itself (see the module)."""

    META_KEY = meta.ISLAND

    def __init__(
        self,
        program: Program,
        policy: PrecisionPolicy | None = None,
        overflow_margin: float = 2.0,
    ) -> None:
        self.program = Program.of(program)
        self.policy = policy or PrecisionPolicy.default()
        self.limit = largest(self.policy.low) / overflow_margin
        # below this (the margin again) every value lies in the 16-bit subnormal range
        self.smallest = smallest_normal(self.policy.low) * overflow_margin

    def call(self, graph_module: GraphModule) -> PassResult:
        ranges = Facts.of(graph_module).float_ranges(self.program)
        for submodule, regions in _regions_by_graph(graph_module).items():
            for node in submodule.graph.nodes:
                node.meta.pop(self.META_KEY, None)
            verdicts = []
            for node, region in regions:
                node.meta[self.META_KEY] = self.verdict(node, region, ranges)
                verdicts.append(node.meta[self.META_KEY])
            # an earlier cast's verdicts on casts its cleanup removed stay in the report
            names = {node.name for node in submodule.graph.nodes}
            earlier = [v for v in submodule.meta.get(self.META_KEY, []) if v.opening not in names]
            submodule.meta[self.META_KEY] = earlier + verdicts
        return PassResult(graph_module, False)

    def verdict(self, opening: Node, region: list[Node], ranges: FloatRanges) -> Island:
        setting = self.policy.explicit_fp32
        if setting == "calibrated":
            keep, why = self.evidence(region, ranges)
        else:
            keep, why = setting == "keep", f"the policy's explicit_fp32={setting!r}"
        return Island(
            opening.name,
            op_label(opening),
            keep,
            FP32 if keep else self.policy.low,
            why,
            frozenset(node.name for node in region if node.graph is opening.graph),
        )

    def evidence(self, region: list[Node], ranges: FloatRanges) -> tuple[bool, str]:
        """(whether the region needs fp32, the evidence either way)."""
        widest, unobserved = None, None
        for node in region:
            val = node_val(node)
            if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
                continue
            conditioning = meta.ill_conditioned(node)
            if conditioning:
                return True, f"{node.name} is ill-conditioned in 16-bit ({conditioning})"
            proven = ranges.of(node)
            magnitude, seen = meta.largest_magnitude(node, proven)
            if magnitude is None:
                unobserved = unobserved or node
            elif meta.overflows(node, self.limit, proven):
                return True, (
                    f"{node.name} reaches {magnitude:.4g} ({seen}), beyond {self.limit:.4g} "
                    "(the 16-bit maximum over the overflow margin)"
                )
            elif (
                0 < magnitude < self.smallest
                and not meta.negligible(node)
                and not meta.bounded_below(node)
            ):
                return True, (
                    f"{node.name} stays below {magnitude:.3g} ({seen}), in the 16-bit "
                    f"subnormal range (under {self.smallest:.3g} with the overflow margin)"
                )
            elif widest is None or magnitude > widest[1]:
                widest = (node.name, magnitude)
        if unobserved is not None:
            return True, f"no calibration input reached {unobserved.name}, so nothing shows it fits"
        if widest is None:
            return False, "it holds no float value"
        return False, (
            f"its values fit 16-bit on the calibration inputs (largest {widest[1]:.4g}, in "
            f"{widest[0]}; limit {self.limit:.4g})"
        )


def model_fp32_regions(graph_module: GraphModule) -> set[Node]:
    """The ops of every fp32 region the model opens, in every graph of the program: what
    ``explicit_fp32="keep"`` keeps fp32."""
    held: set[Node] = set()
    for regions in _regions_by_graph(graph_module).values():
        for _, region in regions:
            held.update(region)
    return held


def _regions_by_graph(graph_module: GraphModule) -> dict[GraphModule, list]:
    """Each graph's ``_regions``, found once while the graph is unchanged (``Facts``):
    the rewrites and the analysis read the same ones."""
    facts = Facts.of(graph_module)
    return facts.derived(
        "explicit fp32 regions",
        lambda: {module: list(_regions(module, facts)) for module in facts.graph_modules},
    )


def _regions(graph_module: GraphModule, facts: Facts):
    """(opening, its region's ops) for each region the graph opens that holds a
    precision-sensitive op."""
    for node in graph_module.graph.nodes:
        region = _opened_region(node, facts)
        if region and any(is_sensitive(member) for member in region):
            yield node, region


def _opened_region(node: Node, facts: Facts) -> list[Node] | None:
    """The ops of the fp32 region ``node`` opens (in bodies too), or None if it opens none
    (``facts``: the program's boundaries, and its nodes' places, which only an
    assertion's region reads)."""
    boundaries = facts.boundaries
    if node.op != "call_function":
        return None
    role = _region_role(node.target)
    if role == "cast" and is_cast(node):  # x.float() of a float value (of an integer: a conversion)
        if cast_dtype(node) != FP32 or node_dtype(node.args[0]) not in FLOAT_DTYPES:
            return None
        return island_region({node}, node.users, boundaries)
    if role == "assert":
        value = node.args[0] if node.args else None
        if asserted_dtype(node) != FP32 or not isinstance(value, Node):
            return None
        # the users the decomposed cast fed: those after the check
        order = facts.positions
        later = sorted((u for u in value.users if order[u] > order[node]), key=order.__getitem__)
        return island_region({value}, later, boundaries)
    if role != "creation" and FP32 in requested_dtypes(node):
        return [node, *island_region({node}, node.users, boundaries)]
    return None


def island_readers(opening: Node, later: list[Node]) -> list[Node]:
    """Of the ops after the fp32 assertion ``opening``, those that read the cast it
    stands for: the island's ops (a residual add reads the 16-bit value, as in the
    source), or all of them when it opens no kept island."""
    verdict = island_verdict(opening)
    if verdict is None or not verdict.keep:
        return later
    return [user for user in later if user.name in verdict.members]


def islands(graph_module: GraphModule) -> list[Island]:
    """The verdicts ExplicitFp32Analysis published for one graph (not its bodies)."""
    return graph_module.meta.get(ExplicitFp32Analysis.META_KEY, [])


@per_op
def _region_role(target) -> str:
    """How an op may open a region: as a cast, an assert of a decomposed cast, a
    creation op (never: its dtype makes a tensor), or by a dtype argument."""
    if target in CAST_OPS:
        return "cast"
    if target in ASSERT_METADATA_OPS:
        return "assert"
    return "creation" if target in CREATION_OPS else "op"
