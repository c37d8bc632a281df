"""ScaleDomainsAnalysis: carry values too large for fp16 at a power-of-two scale.

A scale domain is a set of values connected by ops that commute with a positive
scale (add and sub between members, views, cat, slicing, relu, pooling, sums and
means, a gather of embedding rows; ``fx16.ops.scaling``), grown from each value whose
calibrated magnitude, times the overflow margin, passes fp16's largest. Its values are
carried at ``2**-k``, k the smallest that brings every member inside the limit. A
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
per domain for the report. Only the program's top-level graph is scaled: a
higher-order op reads its operands unscaled.
"""

import math
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.scale_exponents import propagate
from fx16.analysis.scale_plan import StateTensors, float_operands, reads_unscaled_numbers
from fx16.contracts import Analysis
from fx16.decisions import PRECISION
from fx16.meta import observed_max_abs
from fx16.ops.numerics import INF_LIKE
from fx16.ops.scaling import Kind, rule_of
from fx16.program import Program
from fx16.program.nodes import is_float_tensor, mutated_argument, node_val, tensor_leaves
from fx16.program.tensor_subclasses import is_subclass

# Below this largest magnitude every element of a value is subnormal or zero in fp16.
_SMALLEST_NORMAL = float(torch.finfo(torch.float16).tiny)

PLAN_KEY = meta.SCALE_PLAN
DOMAINS_KEY = meta.SCALE_DOMAINS


@dataclass(frozen=True)
class Domain:
    """One scale domain, as the report shows it."""

    k: int  # its values are carried at 2**-k
    values: tuple[str, ...]  # the nodes in it
    folded: tuple[str, ...]  # the state tensors its scale is folded into
    largest: float  # the largest calibrated magnitude of a value in it (unscaled)
    reach: float  # how many times larger its values may grow before 2**-k overflows
    doors: tuple[str, ...] = ()  # user inputs it scales at the door (fp32, then one mul)

    def describe(self) -> str:
        folded = f"folded into {len(self.folded)} tensor(s)" if self.folded else "no fold"
        doors = f"; input(s) {', '.join(self.doors)} scaled at the door" if self.doors else ""
        return (
            f"{self.named()}: {len(self.values)} value(s) up to {self.largest:.3g} carried at "
            f"2**{-self.k} ({folded}{doors}); holds to {self.reach:.3g}x the calibrated "
            "magnitudes"
        )

    def named(self) -> str:
        """Its values by name: the first and the last in graph order ("linear .. add_3")."""
        values = [name for name in self.values if name not in self.folded] or self.values
        return values[0] if len(values) == 1 else f"{values[0]} .. {values[-1]}"


class ScaleDomainsAnalysis(Analysis):
    """Plan the scale domains of a calibrated fp32 program (see the module docstring).

    ``limit``: the largest magnitude taken to fit (fp16's largest over the overflow
    margin). Plans nothing where calibration did not run or nothing passes it, nor in
    a program fx16 cast before (its domains were planned then: a second cast is a
    no-op), nor in one that writes a float value in place (``h.view(-1)[:1].mul_(0.5)``
    left by an export that was not functionalized: a scale or an unscaled copy on the
    way would take the write away from the value it aliases)."""

    needs = (CalibrationAnalysis,)

    def __init__(self, program: Program, limit: float) -> None:
        self.program = Program.of(program)
        self.limit = limit

    def call(self, graph_module: GraphModule) -> PassResult:
        graph_module.meta.pop(PLAN_KEY, None)
        if meta.cast_by_fx16(graph_module, PRECISION):
            return PassResult(graph_module, False)  # its domains were planned then
        graph_module.meta[DOMAINS_KEY] = []
        if _writes_floats_in_place(graph_module):
            return PassResult(graph_module, False)
        tensors = self._foldable_state()
        magnitudes = _magnitudes(graph_module)
        groups = _domains(graph_module, magnitudes, self.limit, tensors)
        if not groups:
            return PassResult(graph_module, False)
        state = StateTensors(tensors, magnitudes, self.limit)
        exponents = {}  # each domain's exponent, by its index in groups
        for index, members in enumerate(groups):
            largest = _largest(members, magnitudes)
            if not _worth_scaling(members, tensors):
                continue
            if largest > self.limit:
                exponents[index] = -max(1, math.ceil(math.log2(largest / self.limit)))
            elif largest < _SMALLEST_NORMAL:  # its largest magnitude brought to [1, 2)
                exponents[index] = -math.floor(math.log2(largest))
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
                break
            for index in started | idle:
                del exponents[index]
        if not exponents:
            return PassResult(graph_module, False)
        domains = []
        order = {node: position for position, node in enumerate(graph_module.graph.nodes)}
        for index, exponent in exponents.items():
            members = sorted(groups[index], key=order.__getitem__)
            largest = _largest(members, magnitudes)
            plan.bounds.update(dict.fromkeys(members, largest))
            folded = tuple(node.name for node in members if node in tensors)
            reach = self.limit / (largest * 2.0**exponent)
            names = tuple(node.name for node in members)
            doors = tuple(n.name for n in members if n.op == "placeholder" and n not in tensors)
            domains.append(Domain(-exponent, names, folded, largest, reach, doors))
        graph_module.meta[PLAN_KEY] = plan
        graph_module.meta[DOMAINS_KEY] = domains
        return PassResult(graph_module, False)

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


def _small(node: Node) -> bool:
    """A value below the normal range worth a domain of its own: a weight some product
    multiplies by, or a product's result (a scale can fold into its factor); a tiny
    bias or addend is absorbed by what it is added to."""
    if node.op == "placeholder":
        return any(
            user.op == "call_function"
            and rule_of(user).kind is Kind.PRODUCT
            and node in float_operands(user, rule_of(user).tensors)
            for user in node.users
        )
    return node.op == "call_function" and rule_of(node).kind is Kind.PRODUCT


def _worth_scaling(members: list[Node], tensors: dict) -> bool:
    """A domain buys something: a tensor folded into range, or a reader beyond it
    (not only the program's outputs, where its scale would be undone at once)."""
    if any(node in tensors for node in members):
        return True
    inside = set(members)
    return any(user not in inside and user.op != "output" for n in members for user in n.users)


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


def _domains(graph_module, magnitudes: dict, limit: float, tensors: dict) -> list[list[Node]]:
    """The domains grown from every value past ``limit`` (a finite, non-sentinel one)."""
    member: dict[Node, int] = {}
    groups: list[list[Node]] = []
    for seed, magnitude in magnitudes.items():
        if seed in member or meta.RANGE_SCALE in seed.meta:
            continue
        if not (
            limit < magnitude < INF_LIKE or (0 < magnitude < _SMALLEST_NORMAL and _small(seed))
        ):
            continue
        index = len(groups)
        groups.append([])
        pending = [seed]
        while pending:
            node = pending.pop()
            found = member.get(node)
            if found == index:
                continue
            if magnitudes.get(node, 0.0) >= INF_LIKE or meta.RANGE_SCALE in node.meta:
                continue  # a mask's sentinel, or where an earlier cast undid a scale
            if found is not None:  # another domain: the two are one
                for other in groups[found]:
                    member[other] = index
                groups[index] += groups[found]
                groups[found] = []
                continue
            member[node] = index
            groups[index].append(node)
            pending += _pulled(node, member, tensors)
            pending += [user for user in node.users if _joins(user, node)]
    return [group for group in groups if group]


def _is_float(node) -> bool:
    return isinstance(node, Node) and any(
        leaf.is_floating_point() for leaf in tensor_leaves(node_val(node))
    )


def _pulled(node: Node, member: dict, tensors: dict) -> list[Node]:
    """What joins ``node``'s domain from its producer's side: the operands of an op that
    commutes with the scale; the state a product or norm reads (where the scale is
    folded) and a bias; an operand of a product already in a domain (the two merge)."""
    if node.op != "call_function" or not _is_float(node):
        return []
    rule = rule_of(node)
    if rule.kind is Kind.SAME:
        return [] if reads_unscaled_numbers(node, rule) else float_operands(node, rule.tensors)
    bias = float_operands(node, (rule.bias,)) if rule.bias is not None else []
    if rule.kind is Kind.PRODUCT:
        operands = float_operands(node, rule.tensors)
        joined = [operand for operand in operands if operand in member]
        if joined:
            return joined[:1]
        candidates = operands[:1] if rule.divides else operands
        state = [operand for operand in candidates if operand in tensors]
        return state[-1:] + bias if state else []
    if rule.kind is Kind.NORM and rule.weight is not None:
        return float_operands(node, (rule.weight, rule.norm_bias or rule.weight))
    if rule.kind is Kind.POWER_OF_BASE and node.args[0] == 2:
        return _logarithm_argument(node.args[1])
    return []


def _logarithm_argument(node) -> list[Node]:
    """m for ``floor(log2(m))`` (or ``log2(m)``): ``2**floor(log2(m))`` scales as m does."""
    while isinstance(node, Node) and node.op == "call_function":
        kind = rule_of(node).kind
        if kind is Kind.LOG2:
            return [node.args[0]] if isinstance(node.args[0], Node) else []
        if kind is not Kind.FLOOR:
            return []
        node = node.args[0]
    return []


def _joins(user: Node, node: Node) -> bool:
    """``user`` commutes with a scale on ``node``: it joins ``node``'s domain."""
    if user.op != "call_function" or not _is_float(user):
        return False
    rule = rule_of(user)
    return (
        rule.kind is Kind.SAME
        and node in float_operands(user, rule.tensors)
        and not reads_unscaled_numbers(user, rule)
    )


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
