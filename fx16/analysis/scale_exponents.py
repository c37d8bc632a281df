"""The exponents a scale plan gives every value, and the multiplies that keep it exact.

``propagate`` walks the graph once, in order, giving each value the power-of-two exponent
it is carried at by its op's rule (``fx16.ops.scaling``). Where a domain wants a value at
its exponent, or an op needs its operands at one (an add, a softmax of unscaled logits),
it first moves the scale into something free (a scalar, a state tensor that op alone
reads: folded at cast time); only where nothing is free does it plan a runtime multiply
by a power of two, on one edge or after a value for every reader. Powers of two are
exact: the planned program computes the same function, up to fp32's own range."""

import operator
from fractions import Fraction
from typing import Any

from torch.fx import Node

from fx16.analysis.scale_moves import PlanMoves
from fx16.analysis.scale_plan import (
    ScalePlan,
    StateTensors,
    argument,
    base_power,
    first_layer_input_weights,
    float_operands,
    floors_by_one,
    holds_in_fp32,
    largest_operand,
    node_leaves,
    numbers_by_keyword,
    only_feeds_powers,
    pushed_below_fp16,
    reads_unscaled_numbers,
)
from fx16.meta import bounded_below
from fx16.ops.scaling import Kind, ScaleRule, rule_of
from fx16.program.nodes import is_float_tensor, is_number, node_val, tensor_leaves


def propagate(nodes: list[Node], wanted: dict[Node, int], state: StateTensors) -> ScalePlan:
    """The plan that carries each node of ``wanted`` at its exponent (state placeholders:
    folded), walking ``nodes`` (one graph's, in order)."""
    plan = ScalePlan(wanted=dict(wanted))
    for node, exponent in wanted.items():
        key = state.key(node)
        if key is not None:
            plan.folds.setdefault(key, exponent)
    walk = _Walk(plan, state)
    for node in nodes:
        walk.visit(node)
    return plan


class _Walk(PlanMoves):
    """One walk of a graph in order: each value's exponent by its op's rule."""

    def visit(self, node: Node) -> None:
        if node.op == "placeholder":
            key = self.state.key(node)
            exponent = self.plan.folds.get(key, 0) if key is not None else 0
            self.plan.exponents[node] = exponent
            want = self.plan.wanted.get(node)
            if want is not None and want != exponent:
                self.plan.after[node] = want - exponent  # an input scaled at the door
            return
        if node.op == "output":
            for leaf in node_leaves(node.args):
                if is_float_tensor(node_val(leaf)) and self.seen(leaf):
                    self.brk(leaf, node, -self.seen(leaf))
            return
        if node.op != "call_function":
            return
        result = self.result(node)
        self.plan.exponents[node] = result
        want = self.plan.wanted.get(node)
        if want is not None and want != result and is_float_tensor(node_val(node)):
            self.plan.after[node] = want - result

    def result(self, node: Node) -> Any:
        val = node_val(node)
        if val is None:
            return 0  # asserts and other ops without a result read metadata only
        if node.target is operator.getitem:
            source, index = node.args[:2]
            exponent = self.plan.exponents.get(source, 0)
            if isinstance(exponent, tuple):
                return exponent[index] if index < len(exponent) else 0
            return exponent
        rule = rule_of(node)
        if rule.scalars and numbers_by_keyword(node):
            return self.opaque(node)  # a bound or fill passed by name: not in the table
        if rule.kind is Kind.SCALE_FREE:
            return self.scale_free(node, rule)
        if not any(leaf.is_floating_point() for leaf in tensor_leaves(val)):
            return self.opaque(node)
        handler = {
            Kind.SAME: self.same,
            Kind.PRODUCT: self.product,
            Kind.POWER: self.power,
            Kind.NORM: self.norm,
            Kind.ATTENTION: self.attention,
            Kind.RECURRENT: self.recurrent,
            Kind.LOG2: self.log2,
            Kind.FLOOR: self.floor,
            Kind.POWER_OF_BASE: self.power_of_base,
            Kind.FILL: self.fill,
            Kind.CREATION: lambda *_: 0,
        }.get(rule.kind)
        return self.opaque(node) if handler is None else handler(node, rule)

    def opaque(self, node: Node, *_) -> int:
        for leaf in node_leaves((node.args, node.kwargs)):
            if is_float_tensor(node_val(leaf)):
                self.settle(leaf, node, 0)
        return 0

    def same(self, node: Node, rule: ScaleRule) -> int:
        operands = float_operands(node, rule.tensors)
        if reads_unscaled_numbers(node, rule) or any(o in self.shifts for o in operands):
            return self.opaque(node)
        target = self.plan.wanted.get(node) if operands else 0
        if target is None:
            target = self.seen(largest_operand(operands))
        for operand in operands:
            self.settle(operand, node, target)
        if bounded_below(node) is None:
            self.scale_scalars(node, rule, target)
        return target

    def product(self, node: Node, rule: ScaleRule) -> int:
        """A product's result: a domain's member at its exponent, any other unscaled,
        where a scale folds into a scalar factor or a weight it alone reads (a layer
        after a scaled input) at no cost. A bias that cannot follow the result brings
        the result to it instead: the scaled operand is unscaled before the product."""
        a, b = (argument(node, p) for p in rule.tensors)
        if a in self.shifts or b in self.shifts:
            return self.opaque(node)
        result = self.seen(a) - self.seen(b) if rule.divides else self.seen(a) + self.seen(b)
        target = self.plan.wanted.get(node, 0)
        if result != target and self.free_refold(node, target - result):
            result = target
        elif not holds_in_fp32(node, result) and isinstance(a, Node) and a is not b:
            self.settle(a, node, target + self.seen(b) if rule.divides else target - self.seen(b))
            result = target
        bias = argument(node, rule.bias)
        if isinstance(bias, Node) and self.seen(bias) != result:
            delta = result - self.seen(bias)
            if not self.refold(bias, delta, added=delta < 0):
                scaled = a if self.seen(a) else b
                if isinstance(scaled, Node) and scaled is not bias:
                    sign = -1 if rule.divides and scaled is b else 1
                    self.brk(scaled, node, sign * -delta)
                    result = self.seen(bias)
                else:
                    self.brk(bias, node, delta)
        return result

    def power(self, node: Node, rule: ScaleRule) -> int:
        x = node.args[0]
        exponent = rule.power
        if exponent is None:
            if not is_number(node.args[1]):
                return self.opaque(node)
            exponent = Fraction(node.args[1])
        result = exponent * self.seen(x)
        if (
            result.denominator != 1
            or not holds_in_fp32(node, int(result))
            or pushed_below_fp16(node, int(result))
        ):
            self.settle(x, node, 0)
            return 0
        return int(result)

    def norm(self, node: Node, rule: ScaleRule) -> Any:
        def arg(position):
            return argument(node, position)

        if arg(rule.training):
            return self.opaque(node)
        x = node.args[0]
        scale = self.seen(x)
        weight = arg(rule.weight)
        result = self.seen(weight) if isinstance(weight, Node) else 0
        if (
            scale
            and isinstance(arg(rule.variance), Node)
            and isinstance(weight, Node)
            and self.refold(weight, -scale)
        ):
            # running statistics: a per-channel affine whose weight takes the scale back;
            # the variance and eps stay as they are (at 2**(2 * scale) they would flush)
            variance, rstd = 0, 0
        else:
            if scale and not self.scale_eps(node, rule, 2.0 ** (2 * scale)):
                self.settle(x, node, 0)
                scale = 0
            variance, rstd = 2 * scale, -scale
        for position, target in (
            (rule.mean, scale),
            (rule.variance, variance),
            (rule.norm_bias, result),
        ):
            if isinstance(arg(position), Node):
                self.settle(arg(position), node, target)
        if isinstance(node_val(node), (tuple, list)):
            return (result, scale, rstd)[: len(node_val(node))]
        return result

    def scale_free(self, node: Node, rule: ScaleRule) -> int:
        if reads_unscaled_numbers(node, rule):
            return self.opaque(node)
        operands = float_operands(node, rule.tensors)
        target = self.seen(largest_operand(operands)) if operands else 0
        for operand in operands:
            self.settle(operand, node, target)
        self.scale_scalars(node, rule, target)
        return 0

    def attention(self, node: Node, rule: ScaleRule) -> int:
        query, key, value = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        for operand in (query, key, mask):
            if isinstance(operand, Node) and is_float_tensor(node_val(operand)):
                self.settle(operand, node, 0)
        return self.seen(value)

    def recurrent(self, node: Node, rule: ScaleRule) -> int:
        """An RNN's gates read ``x W_ih`` (the first layer's input weights, one per
        direction), which must be unscaled: the input's scale folds into the weights,
        or, where the weights carry a scale of their own (weights below fp16's normal
        range, lifted), the input is brought to the inverse (at the door, in the same
        multiply, where it is a door only this op reads). Its initial states are read
        unscaled; its results are unscaled."""
        x = node.args[0]
        weights = first_layer_input_weights(node, rule)
        lifted = {self.seen(weight) for weight in weights}
        lift = next(iter(lifted), 0)
        if len(lifted) > 1:  # directions at different exponents: all unscaled
            lift = 0
            for weight in weights:
                self.settle(weight, node, 0)
        delta = -lift - self.seen(x)  # what x (or the weights) must move by: x W unscaled
        if delta and not (lift and self.lower_door(x, node, delta)):
            if not self.refold_all(weights, delta):
                self.settle(x, node, -lift)
        for state in node_leaves(node.args[1]):
            if is_float_tensor(node_val(state)):
                self.settle(state, node, 0)
        return 0

    def fill(self, node: Node, rule: ScaleRule) -> int:
        target = self.plan.wanted.get(node, 0)
        self.scale_scalars(node, rule, target)
        return target

    def log2(self, node: Node, rule: ScaleRule) -> int:
        x = node.args[0]
        if self.seen(x) and only_feeds_powers(node):
            self.shifts[node] = self.seen(x)
            return 0
        return self.opaque(node)

    def floor(self, node: Node, rule: ScaleRule) -> int:
        if node.args[0] in self.shifts and floors_by_one(node):
            self.shifts[node] = self.shifts[node.args[0]]
            return 0
        return self.opaque(node)

    def power_of_base(self, node: Node, rule: ScaleRule) -> int:
        power, exponent = base_power(node), node.args[1]
        if exponent not in self.shifts or power is None:
            return self.opaque(node)
        return power * self.shifts[exponent]
