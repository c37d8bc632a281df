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

from fx16.analysis.scale_plan import (
    ScalePlan,
    StateTensors,
    argument,
    float_operands,
    holds_in_fp32,
    largest_operand,
    log2_exact,
    node_leaves,
    numbers_by_keyword,
    only_feeds_powers,
    reads_unscaled_numbers,
)
from fx16.meta import bounded_below
from fx16.ops.scaling import Kind, ScaleRule, rule_of
from fx16.program.nodes import is_float_tensor, is_number, named_argument, node_val, tensor_leaves


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


class _Walk:
    def __init__(self, plan: ScalePlan, state: StateTensors) -> None:
        self.plan, self.state = plan, state
        self.shifts: dict[Node, int] = {}  # log2 of a scaled value: shifted by its exponent

    # ---- reading ------------------------------------------------------------------

    def seen(self, value: Any) -> int:
        """The exponent a reader of ``value`` sees (after a break for every reader)."""
        if not isinstance(value, Node):
            return 0
        exponent = self.plan.exponents.get(value, 0)
        if isinstance(exponent, tuple):
            return 0
        return exponent + self.plan.after.get(value, 0)

    # ---- changing ------------------------------------------------------------------

    def brk(self, value: Node, reader: Node, delta: int) -> None:
        """Plan ``value * 2**delta`` for ``reader`` only."""
        if delta:
            self.plan.edges.setdefault((value, delta), []).append(reader)

    def scale_scalar(self, node: Node, position: int, factor: float) -> None:
        key = (node, ("args", position))
        current = self.plan.scalars.get(key, node.args[position])
        self.plan.scalars[key] = current * factor

    def scale_scalars(self, node: Node, rule: ScaleRule, exponent: int) -> None:
        """Scale by ``2**exponent`` the numbers ``node`` passes at ``rule.scalars``."""
        for position in rule.scalars:
            if exponent and position < len(node.args) and is_number(node.args[position]):
                self.scale_scalar(node, position, 2.0**exponent)

    def scale_eps(self, node: Node, rule: ScaleRule, factor: float) -> bool:
        """Scale a norm's eps, passed or left to its default; False where it has none."""
        if rule.eps < len(node.args):
            location, value = ("args", rule.eps), node.args[rule.eps]
        else:
            location, value = ("kwargs", "eps"), named_argument(node, "eps")
        value = self.plan.scalars.get((node, location), value)
        if not is_number(value):
            return False
        self.plan.scalars[(node, location)] = value * factor
        return True

    def refold(self, value: Node, delta: int, added: bool = False) -> bool:
        """Move ``2**delta`` into something free that only ``value``'s reader sees: a
        state tensor read there alone, or a scalar factor of the product it is."""
        if delta == 0:
            return True
        if len(value.users) != 1 or value in self.plan.after or value in self.shifts:
            return False
        if value.op == "placeholder":
            key = self.state.key(value)
            if not self.state.movable(value, self.plan.folds.get(key, 0) + delta, added):
                return False
            self.plan.folds[key] = self.plan.folds.get(key, 0) + delta
            self.plan.exponents[value] = self.plan.exponents.get(value, 0) + delta
            return True
        if value.op != "call_function" or rule_of(value).kind is not Kind.PRODUCT:
            return False
        rule = rule_of(value)
        a, b = (value.args[p] for p in rule.tensors)
        if not self._refold_product(value, rule, a, b, delta):
            return False
        self.plan.exponents[value] = self.plan.exponents.get(value, 0) + delta
        return True

    def _refold_product(self, value: Node, rule: ScaleRule, a, b, delta: int) -> bool:
        if argument(value, rule.bias) is not None:
            return False
        if self._fold_number(value, rule, delta):
            return True
        if a is b and not rule.divides:
            return delta % 2 == 0 and self.refold(a, delta // 2)
        return any(
            isinstance(operand, Node) and self.refold(operand, sign * delta)
            for operand, sign in ((b, -1 if rule.divides else 1), (a, 1))
        )

    def _fold_number(self, node: Node, rule: ScaleRule, delta: int) -> bool:
        """Move ``2**delta`` into the product ``node``'s number operand, if it has one."""
        for position, sign in ((rule.tensors[1], -1 if rule.divides else 1), (rule.tensors[0], 1)):
            if is_number(argument(node, position)):
                self.scale_scalar(node, position, 2.0 ** (sign * delta))
                return True
        return False

    def settle(self, operand: Node, reader: Node, target: int) -> None:
        """Bring ``operand`` to ``target`` for ``reader``: fold it, else a break."""
        delta = target - self.seen(operand)
        if delta and not self.refold(operand, delta):
            self.brk(operand, reader, delta)

    # ---- the walk ----------------------------------------------------------------------

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
        if rule.kind is Kind.SCALE_FREE:
            if rule.scalars and numbers_by_keyword(node):
                return self.opaque(node)
            return self.scale_free(node, rule)
        if not any(leaf.is_floating_point() for leaf in tensor_leaves(val)):
            return self.opaque(node)
        if rule.scalars and numbers_by_keyword(node):
            return self.opaque(node)  # a bound or fill passed by name: not in the table
        handler = {
            Kind.SAME: self.same,
            Kind.PRODUCT: self.product,
            Kind.POWER: self.power,
            Kind.NORM: self.norm,
            Kind.ATTENTION: self.attention,
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

    def free_refold(self, node: Node, delta: int) -> bool:
        """Move ``2**delta`` into the product ``node``'s scalar factor or a state tensor
        it alone reads (never into another value's exponent)."""
        rule = rule_of(node)
        if rule.kind is not Kind.PRODUCT:
            return False
        if self._fold_number(node, rule, delta):
            return True
        a, b = (argument(node, p) for p in rule.tensors)
        for operand, sign in ((b, -1 if rule.divides else 1), (a, 1)):
            if isinstance(operand, Node) and operand.op == "placeholder":
                if self.refold(operand, sign * delta):
                    return True
        return False

    def power(self, node: Node, rule: ScaleRule) -> int:
        x = node.args[0]
        exponent = rule.power
        if exponent is None:
            if not is_number(node.args[1]):
                return self.opaque(node)
            exponent = Fraction(node.args[1])
        result = exponent * self.seen(x)
        if result.denominator != 1 or not holds_in_fp32(node, int(result)):
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
        if scale and not self.scale_eps(node, rule, 2.0 ** (2 * scale)):
            self.settle(x, node, 0)
            scale = 0
        for position, target in ((rule.mean, scale), (rule.variance, 2 * scale)):
            if isinstance(arg(position), Node):
                self.settle(arg(position), node, target)
        weight, bias = arg(rule.weight), arg(rule.norm_bias)
        result = self.seen(weight) if isinstance(weight, Node) else 0
        if isinstance(bias, Node):
            self.settle(bias, node, result)
        if isinstance(node_val(node), (tuple, list)):
            return (result, scale, -scale)[: len(node_val(node))]
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
        x = node.args[0]
        floor_by_one = node.kwargs.get("rounding_mode") == "floor" and node.args[1:2] in (
            (1,),
            (1.0,),
        )
        if x in self.shifts and (len(node.args) == 1 or floor_by_one):
            self.shifts[node] = self.shifts[x]
            return 0
        return self.opaque(node)

    def power_of_base(self, node: Node, rule: ScaleRule) -> int:
        base, exponent = node.args[:2]
        if exponent not in self.shifts:
            return self.opaque(node)
        power = log2_exact(Fraction(base) if is_number(base) and base > 0 else None)
        if power is None:
            return self.opaque(node)
        return power * self.shifts[exponent]
