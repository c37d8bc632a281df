"""A scale plan as data (``ScalePlan``), the state tensors a plan may fold into
(``StateTensors``), and the small questions ``fx16.analysis.scale_exponents`` asks of
nodes while it makes one."""

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch.fx import Node

from fx16 import meta
from fx16.meta import observed_max_abs
from fx16.ops.numeric_tables import SUMMING_OPS
from fx16.ops.numerics import smallest_normal
from fx16.ops.scaling import Kind, ScaleRule, rule_of
from fx16.ops.tables import VALUE_PRESERVING_OPS
from fx16.program.nodes import Location, is_float_tensor, is_number, node_val


@dataclass
class ScalePlan:
    """What applying a set of scale domains changes (``fx16.passes.scale_domains``)."""

    exponents: dict[Node, Any] = field(default_factory=dict)  # int, or a tuple per leaf
    folds: dict[int, int] = field(default_factory=dict)  # id(state tensor) -> exponent
    scalars: dict[tuple[Node, Location], float] = field(default_factory=dict)
    after: dict[Node, int] = field(default_factory=dict)  # value -> delta, for every reader
    edges: dict[tuple[Node, int], list[Node]] = field(default_factory=dict)  # (value, delta)
    wanted: dict[Node, int] = field(default_factory=dict)  # the domains' members
    # each member's domain's largest calibrated magnitude: what a member may hold on
    # other inputs (a where or a max picks any member's values), unscaled
    bounds: dict[Node, float] = field(default_factory=dict)


class StateTensors:
    """The state placeholders a plan may fold a scale into: one exponent per tensor
    (a tensor stored under several names is one), and which of them a scale may be
    moved into late (read by one op, through one name)."""

    def __init__(self, tensors: dict[Node, Any], magnitudes: dict, limit: float) -> None:
        self.tensor_of = {node: id(tensor) for node, tensor in tensors.items()}
        self.magnitudes, self.limit = magnitudes, limit
        names: dict[int, list[Node]] = {}
        for node, key in self.tensor_of.items():
            names.setdefault(key, []).append(node)
        self.names = names

    def key(self, node: Node) -> int | None:
        return self.tensor_of.get(node)

    def movable(self, node: Node, exponent: int = 0, added: bool = False) -> bool:
        """A scale may be moved into ``node`` late, and at ``exponent`` it fits (a
        weight's elements stay normal; ``added``: a bias, which the product it is added
        to absorbs, may shrink further)."""
        key = self.tensor_of.get(node)
        if key is None or len(self.names[key]) != 1 or len(node.users) != 1:
            return False
        magnitude = self.magnitudes.get(node, 0.0)
        scaled = magnitude * 2.0**exponent
        if not magnitude or added:
            return scaled <= self.limit
        return min(magnitude, SMALLEST_FOLDED) <= scaled <= self.limit


FP16_LARGEST = float(torch.finfo(torch.float16).max)

# Below this largest magnitude every element of a value is subnormal or zero in fp16.
SMALLEST_NORMAL = smallest_normal(torch.float16)

# A fold never takes a state tensor's largest magnitude below this (nor below where it
# was): its small elements would leave the 16-bit normal range.
SMALLEST_FOLDED = 2.0**-8


def is_layout_view(node: Any) -> bool:
    """``node`` rearranges one tensor's values (a permute, transpose, reshape, slice):
    a scale on that tensor is a scale on ``node``."""
    return (
        isinstance(node, Node)
        and node.op == "call_function"
        and VALUE_PRESERVING_OPS.get(node.target) == (0,)
        and isinstance(node.args[0], Node)
    )


def beneath_views(node: Any) -> Any:
    """``node``, or the tensor its chain of layout views reads (core ATen's linear reads
    its weight as ``permute(w)``)."""
    while is_layout_view(node):
        node = node.args[0]
    return node


def argument(node: Node, position: int | None) -> Any:
    """``node.args[position]``, None where the position is None or not passed."""
    return node.args[position] if position is not None and position < len(node.args) else None


def log2_exact(value: Fraction | None) -> int | None:
    """k where ``value`` is 2**k exactly, else None."""
    if value is None or value.numerator & (value.numerator - 1):
        return None
    if value.denominator & (value.denominator - 1):
        return None
    return value.numerator.bit_length() - value.denominator.bit_length()


def only_feeds_powers(node: Node) -> bool:
    """Every use of ``node`` (a log2) ends in ``pow(2**b, .)``, through floors by 1: the
    chain a stabilized norm computes its scale with, where a scale on the log2's
    argument comes back out of the power."""
    for user in node.users:
        kind = rule_of(user).kind if user.op == "call_function" else None
        if kind is Kind.FLOOR and user.args[0] is node and floors_by_one(user):
            if not only_feeds_powers(user):
                return False
        elif not (
            kind is Kind.POWER_OF_BASE and user.args[1] is node and base_power(user) is not None
        ):
            return False
    return True


def floors_by_one(node: Node) -> bool:
    """``node`` (an op of kind FLOOR) is ``floor(x)`` or ``x // 1``: an integer shift of
    x comes through it whole."""
    floor_division = node.kwargs.get("rounding_mode") == "floor"
    return len(node.args) == 1 or floor_division and node.args[1:2] in ((1,), (1.0,))


def base_power(node: Node) -> int | None:
    """b where ``node`` (an op of kind POWER_OF_BASE) is ``pow(2**b, .)``, else None."""
    base = node.args[0]
    return log2_exact(Fraction(base) if is_number(base) and base > 0 else None)


def largest_operand(operands: list[Node]) -> Node | None:
    """The operand with the largest observed magnitude (the first when none was seen)."""
    if not operands:
        return None
    return max(operands, key=lambda operand: observed_max_abs(operand) or 0.0)


def float_operands(node: Node, positions) -> list[Node]:
    """The float tensors ``node`` passes at ``positions`` (a position may hold a list)."""
    return [
        item
        for position in positions
        for item in node_leaves(argument(node, position))
        if is_float_tensor(node_val(item))
    ]


def first_layer_input_weights(node: Node, rule: ScaleRule) -> list[Node]:
    """The input weights of an RNN's first layer, one per direction (the weight list
    holds each layer's and direction's matrices and biases in turn); [] where the list
    is not one of state tensors of the expected length."""
    weights = argument(node, rule.params)
    layers, bidirectional = argument(node, rule.layers), argument(node, rule.bidirectional)
    if not isinstance(weights, (list, tuple)) or not isinstance(layers, int) or layers < 1:
        return []
    directions = 2 if bidirectional else 1
    if len(weights) % (layers * directions):
        return []
    stride = len(weights) // (layers * directions)
    found = [weights[direction * stride] for direction in range(directions)]
    return found if all(isinstance(weight, Node) for weight in found) else []


def holds_in_fp32(node: Node, exponent: int) -> bool:
    """``node``'s calibrated values, times ``2**exponent``, stay in fp32's normal range:
    the product of two scaled operands adds their exponents, and a wide domain's
    exponent doubled can push its smallest elements into fp32's subnormals."""
    smallest, largest = node.meta.get(meta.OBSERVED_SMALLEST), observed_max_abs(node)
    if smallest and math.log2(smallest) + exponent < _FP32_SMALLEST_EXPONENT:
        return False
    return not largest or math.log2(largest) + exponent < _FP32_LARGEST_EXPONENT


def pushed_below_fp16(node: Node, exponent: int) -> bool:
    """A scale down (``exponent`` < 0) takes ``node``'s smallest calibrated nonzero
    magnitude below fp16's normal range, where an op other than a sum or mean reads it:
    the scale alone would flush small elements that reader sees one by one, or take
    bits from ones already subnormal (a power multiplies its operand's exponent: x
    carried at 2**-28 squared is at 2**-56; x**3 of 1e-2 readings, 1e-6, carried at
    2**-6 keeps 1 bit of 7; a mean of squares absorbs the small ones)."""
    smallest = node.meta.get(meta.OBSERVED_SMALLEST)
    if not smallest or exponent >= 0 or smallest * 2.0**exponent >= SMALLEST_NORMAL:
        return False
    return any(user.target not in SUMMING_OPS for user in node.users)


_FP32_SMALLEST_EXPONENT = math.log2(torch.finfo(torch.float32).tiny)
_FP32_LARGEST_EXPONENT = math.log2(torch.finfo(torch.float32).max)


def reads_unscaled_numbers(node: Node, rule: ScaleRule) -> bool:
    """``node`` reads, where its rule passes the scale through (``rule.tensors``,
    ``rule.scalars``), a value that cannot carry one: an integer or bool tensor, or a
    symbolic number (``x + offsets`` with int offsets). A scale on its float operands
    would not reach it, so the op computes unscaled."""
    for position in (*rule.tensors, *rule.scalars):
        for item in node_leaves(argument(node, position)):
            if not is_float_tensor(node_val(item)):
                return True
    return False


def node_leaves(value: Any) -> list[Node]:
    found: list[Node] = []
    if isinstance(value, Node):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            found += node_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            found += node_leaves(item)
    return found


def numbers_by_keyword(node: Node) -> bool:
    """``node`` passes a number by keyword (``clamp(x, max=6.0)``): the rule tables name
    scalars by position, so such a number would not be scaled."""
    return any(is_number(value) for value in node.kwargs.values())
