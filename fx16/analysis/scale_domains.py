"""ScaleDomainsAnalysis: carry values too large for fp16 at a power-of-two scale.

A scale domain is a set of values connected by ops that commute with a positive
scale (add and sub between members, views, cat, slicing, relu, pooling, sums and
means, a gather of embedding rows; ``fx16.ops.scaling``), grown from each value whose
calibrated magnitude, times the overflow margin, passes fp16's largest. Its values are
carried at ``2**-k``, k centred between the least that brings every member inside the
limit and the most its folded tensors allow (``fx16.analysis.scale_centre``). A
domain starts where the scale can be folded at cast time: into the state tensor that
a product (linear, conv, matmul, mul) or a norm's affine reads (its bias too), an
embedding table, a scalar; or, where nothing is free, at a runtime multiply by
``2**-k`` (after an activation, or at the door after a user input). It closes where
the scale cancels (a norm: RMSNorm's ``x * rsqrt(mean(x**2) + eps)`` with eps scaled
by ``2**-2k``, LayerNorm, GroupNorm; a BatchNorm on running statistics, a per-channel
affine, takes the scale back into its weight, its mean scaled alike, its variance and
eps as they are) or at an output, where a multiply undoes it.

Power-of-two scales move no mantissa bit: the planned program computes the same
function as the original in fp32. A power of two is what makes the residual stream
of a pre-norm transformer (T5 v1.1, LLMs with massive activations) or a CNN whose
activations grow block by block fit fp16 without fp32.

Reads: ``meta["fx16.observed_range"]`` (``CalibrationAnalysis``), the program's state
tensors. Writes: ``graph_module.meta["fx16.scale_plan"]`` (a ``ScalePlan``: every
value's exponent, the folds, the scalars, the runtime multiplies; applied by
``ScaleDomainsPass``) and ``graph_module.meta["fx16.scale_domains"]``, a ``Domain``
per domain for the report (on the program's graph: every graph's). Each body of a
higher-order op (a cond's branch, a loop's body) is planned as a graph of its own, its
operands entering unscaled (a domain inside starts at a multiply after the body's
placeholder, where nothing is free) and its results leaving unscaled; a state tensor
the program passes to that body alone takes a body's fold. Its plan is on the body's
graph module.
"""

import math
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.explicit_fp32 import model_fp32_regions
from fx16.analysis.facts import Facts
from fx16.analysis.scale_centre import centre
from fx16.analysis.scale_exponents import propagate
from fx16.analysis.scale_members import grow_domains
from fx16.analysis.scale_plan import FP16_LARGEST, SMALLEST_FOLDED, SMALLEST_NORMAL, StateTensors
from fx16.analysis.scale_upstream import upstream_fold
from fx16.contracts import Analysis
from fx16.decisions import PRECISION
from fx16.meta import observed_max_abs
from fx16.ops.scaling import Kind, rule_of
from fx16.program import Program
from fx16.program.nodes import is_float_tensor, mutated_argument, node_val
from fx16.program.tensor_subclasses import is_subclass

PLAN_KEY = meta.SCALE_PLAN
DOMAINS_KEY = meta.SCALE_DOMAINS


@dataclass(frozen=True)
class Domain:
    """One scale domain, as the report shows it."""

    k: int  # its values are carried at 2**-k
    values: tuple[str, ...]  # the nodes in it
    folded: tuple[str, ...]  # the state tensors its scale is folded into
    largest: float  # the largest calibrated magnitude of a value in it (unscaled)
    # how many times larger its values may grow before 2**-k passes fp16's largest (no
    # margin: the unit of the envelope's figures; the overflow margin is stated there)
    reach: float
    doors: tuple[str, ...] = ()  # user inputs it scales at the door (fp32, then one mul)
    bounded: str = ""  # what bounded k at each end (``fx16.analysis.scale_centre``)

    def describe(self) -> str:
        folded = f"folded into {len(self.folded)} tensor(s)" if self.folded else "no fold"
        doors = f"; input(s) {', '.join(self.doors)} scaled at the door" if self.doors else ""
        bounded = f"; {self.bounded}" if self.bounded else ""
        return (
            f"{self.named()}: {len(self.values)} value(s) up to {self.largest:.3g} carried at "
            f"2**{-self.k} ({folded}{doors}{bounded}); holds to {self.reach:.3g}x the "
            "calibrated magnitudes before passing 65504"
        )

    def named(self) -> str:
        """Its values by name: the first and the last in graph order ("linear .. add_3")."""
        values = [name for name in self.values if name not in self.folded] or self.values
        return values[0] if len(values) == 1 else f"{values[0]} .. {values[-1]}"


class ScaleDomainsAnalysis(Analysis):
    """Plan the scale domains of a calibrated fp32 program (see the module docstring).

    ``limit``: the largest magnitude taken to fit (fp16's largest over the overflow
    margin). ``keep_model_fp32``: the model's own fp32 regions stay fp32 whatever they
    hold (the policy's ``explicit_fp32="keep"``), so no domain starts or grows inside
    one: a scale there would only add multiplies to values that never see fp16 (with
    "calibrated", a domain may be what lets a region fit, and retarget it to 16-bit).
    Plans nothing where calibration did not run or nothing passes it, nor in a program fx16 cast
    before (its domains were planned then: a second cast is a no-op), nor in one that
    writes a float value in place (``h.view(-1)[:1].mul_(0.5)`` left by an export that
    was not functionalized: a scale or an unscaled copy on the way would take the write
    away from the value it aliases)."""

    needs = (CalibrationAnalysis,)

    def __init__(self, program: Program, limit: float, keep_model_fp32: bool = True) -> None:
        self.program = Program.of(program)
        self.limit = limit
        self.keep_model_fp32 = keep_model_fp32

    def call(self, graph_module: GraphModule) -> PassResult:
        boundaries = Facts.of(graph_module).boundaries
        for module in boundaries.graph_modules:
            module.meta.pop(PLAN_KEY, None)
        if meta.cast_by_fx16(graph_module, PRECISION):
            return PassResult(graph_module, False)  # its domains were planned then
        graph_module.meta[DOMAINS_KEY] = []
        if not CalibrationAnalysis.observed(graph_module):
            return PassResult(graph_module, False)  # no magnitudes to plan from
        if any(_writes_floats_in_place(module) for module in boundaries.graph_modules):
            return PassResult(graph_module, False)
        tensors = self._foldable_state()
        # values the model computes in fp32 itself stay fp32: no domain there
        fp32 = model_fp32_regions(graph_module) if self.keep_model_fp32 else set()
        domains = []
        for module in boundaries.graph_modules:
            state = tensors if module is graph_module else _body_state(module, boundaries, tensors)
            planned = self._plan(module, state, fp32)
            if planned is not None:
                module.meta[PLAN_KEY], found = planned
                domains += found
        graph_module.meta[DOMAINS_KEY] = domains
        return PassResult(graph_module, False)

    def _plan(self, graph_module: GraphModule, tensors: dict, fp32: set):
        """The plan of one graph (the program's, or a body's with the state tensors only
        it reads) and its domains; None where it has none."""
        magnitudes = _magnitudes(graph_module)
        groups = grow_domains(magnitudes, self.limit, tensors, fp32)
        if not groups:
            return None
        state = StateTensors(tensors, magnitudes, self.limit)
        exponents = {}  # each domain's exponent, by its index in groups
        for index, members in enumerate(groups):
            largest = _largest(members, magnitudes)
            if not _worth_scaling(members, tensors):
                continue
            if largest > self.limit:
                exponents[index] = -max(1, math.ceil(math.log2(largest / self.limit)))
            elif largest < SMALLEST_NORMAL and all(meta.negligible(m) for m in members):
                continue  # values a rewrite made that may flush: nothing to keep
            elif largest < SMALLEST_NORMAL:  # its largest magnitude brought to [1, 2)
                exponents[index] = -math.floor(math.log2(largest))
            elif (lift := self._lift(members, tensors, magnitudes, largest)) is not None:
                exponents[index] = lift
        plan = None
        while exponents:
            wanted = {n: exponents[i] for i in exponents for n in groups[i]}
            plan = propagate(list(graph_module.graph.nodes), wanted, state)
            # the small end only where its scale folds into the tensors and scalars it
            # starts from (a runtime multiply there would flush what it should keep)
            started = {
                i for i in exponents if exponents[i] > 0 and plan.after.keys() & set(groups[i])
            }
            idle = {i for i in exponents if _buys_nothing(groups[i], plan)}
            if not started | idle:
                if _fold_upstream(groups, exponents, plan, state):
                    continue  # a product of activations takes its scale from weights
                break
            for index in started | idle:
                del exponents[index]
        if not exponents:
            return None
        nodes = list(graph_module.graph.nodes)
        exponents, plan, centrings = centre(
            nodes, groups, exponents, plan, state, magnitudes, self.limit
        )
        domains = []
        order = {node: position for position, node in enumerate(graph_module.graph.nodes)}
        for index, exponent in exponents.items():
            members = sorted(groups[index], key=order.__getitem__)
            largest = _largest(members, magnitudes)
            plan.bounds.update(dict.fromkeys(members, largest))
            folded = tuple(node.name for node in members if node in tensors)
            reach = FP16_LARGEST / (largest * 2.0**exponent)
            names = tuple(node.name for node in members)
            doors = tuple(n.name for n in members if n.op == "placeholder" and n not in tensors)
            centring = centrings.get(index)
            bounded = centring.describe(-exponent) if centring is not None else ""
            domains.append(Domain(-exponent, names, folded, largest, reach, doors, bounded))
        return plan, domains

    def _lift(self, members, tensors: dict, magnitudes: dict, largest: float) -> int | None:
        """The exponent that carries a domain's state tensors wholly below fp16's normal
        range (a dequantize's block scales of 1e-6) at a power of two that brings their
        largest magnitudes to at least ``SMALLEST_FOLDED``, where every other member stays
        within ``limit`` at it; None where no member needs it or no exponent fits both."""
        small = [
            magnitudes[n]
            for n in members
            if n in tensors and 0 < magnitudes.get(n, 0) < SMALLEST_NORMAL
        ]
        if not small:
            return None
        needed = math.ceil(math.log2(SMALLEST_FOLDED / min(small)))
        room = math.floor(math.log2(self.limit / largest))
        return needed if 0 < needed <= room else None

    def _foldable_state(self) -> dict[Node, torch.Tensor]:
        """State placeholders whose float tensor a scale can be folded into: a plain
        tensor (not a quantized subclass) the program does not write in place."""
        mutated = set(self.program.ep.graph_signature.buffers_to_mutate.values())
        found = {}
        for slot in self.program.state_slots():
            tensor = self.program.state_tensor(slot.target)
            if (
                tensor is not None
                and tensor.is_floating_point()
                and not is_subclass(tensor)
                and slot.target not in mutated
            ):
                found[slot.placeholder] = tensor
        return found


def _worth_scaling(members: list[Node], tensors: dict) -> bool:
    """A domain buys something: a tensor folded into range, or a reader beyond it
    (not only the program's outputs, where its scale would be undone at once)."""
    if any(node in tensors for node in members):
        return True
    inside = set(members)
    return any(user not in inside and user.op != "output" for n in members for user in n.users)


def _body_state(body: GraphModule, boundaries, tensors: dict) -> dict:
    """The state tensors a body may fold a scale into: a placeholder fed by one of the
    program's foldable state tensors that no other graph reads (the program passes it
    to this higher-order op alone, and no other body of it uses it)."""
    found = {}
    for node in body.graph.nodes:
        if node.op != "placeholder" or not node.users:
            continue
        sources = boundaries.crossing_sources(node)
        if len(sources) != 1 or sources[0] not in tensors:
            continue
        source = sources[0]
        readers = [sink for sink in boundaries.crossing_sinks(source) if sink.users]
        if readers == [node] and all(user in boundaries.looked_into for user in source.users):
            found[node] = tensors[source]
    return found


def _buys_nothing(members: list[Node], plan) -> bool:
    """Every member is computed as it was (exponent 0), and the runtime multiply after
    one is undone for each of its readers: no op reads a scaled value (attention logits
    whose product overflows, read unscaled by a softmax and an output, would only gain
    two multiplies)."""
    for node in members:
        exponent = plan.exponents.get(node, 0)
        if any(e != 0 for e in (exponent if isinstance(exponent, tuple) else (exponent,))):
            return False
        delta = plan.after.get(node)
        if delta is not None:
            undone = plan.edges.get((node, -delta), [])
            if any(user not in undone for user in node.users):
                return False
    return True


def _fold_upstream(groups: list, exponents: dict, plan, state: StateTensors) -> bool:
    """Add to each domain the weights upstream of one operand of each product of
    activations the plan could only scale by a runtime multiply after it (logits
    ``q kᵀ``: ``fx16.analysis.scale_upstream``); whether any were added."""
    member = {node for index in exponents for node in groups[index]}
    added = False
    for index, exponent in exponents.items():
        for node in list(groups[index]):
            if node not in plan.after or plan.exponents.get(node) != 0:
                continue
            if rule_of(node).kind is not Kind.PRODUCT:
                continue
            found = upstream_fold(node, state, exponent)
            if found and not set(found) & member:
                groups[index] += found
                member |= set(found)
                added = True
    return added


def _largest(members: list[Node], magnitudes: dict) -> float:
    return max(magnitudes.get(node, 0.0) for node in members)


def _magnitudes(graph_module: GraphModule) -> dict:
    """The largest finite magnitude calibration saw in each single-tensor value (state
    placeholders included: calibration observes them too)."""
    found = {}
    for node in graph_module.graph.nodes:
        seen = observed_max_abs(node)
        if seen is not None and is_float_tensor(node_val(node)):
            found[node] = seen
    return found


def _writes_floats_in_place(graph_module: GraphModule) -> bool:
    """Whether an op of the graph writes a float tensor in place."""
    for node in graph_module.graph.nodes:
        written = mutated_argument(node) if node.op == "call_function" else None
        if written is not None and is_float_tensor(node_val(written)):
            return True
    return False


def scale_domains(graph_module: GraphModule) -> list[Domain]:
    """The scale domains a cast of ``graph_module`` carries (none where it scaled nothing)."""
    return list(graph_module.meta.get(DOMAINS_KEY, []))
