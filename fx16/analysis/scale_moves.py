"""How a scale plan moves a power of two: into something free (a scalar the op passes,
a state tensor that op alone reads, folded at cast time), else into a runtime multiply on
one edge. ``fx16.analysis.scale_exponents`` walks a graph with these moves."""

from typing import Any

from torch.fx import Node

from fx16.analysis.scale_plan import (
    FP16_LARGEST,
    SMALLEST_FOLDED,
    ScalePlan,
    StateTensors,
    argument,
    beneath_views,
    is_layout_view,
)
from fx16.meta import observed_max_abs
from fx16.ops.scaling import Kind, ScaleRule, rule_of
from fx16.program.nodes import is_number, named_argument


class PlanMoves:
    """A plan being made, and the moves that keep it exact (``seen`` reads it)."""

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
        state tensor read there alone (directly or through layout views it alone
        reads), or a scalar factor of the product it is."""
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
        if is_layout_view(value):  # a weight read through a permute: fold beneath it
            if not self.refold(value.args[0], delta, added):
                return False
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
        return self._fold_operands(rule, a, b, delta)

    def _fold_operands(self, rule: ScaleRule, a, b, delta: int, states_only: bool = False) -> bool:
        """Move ``2**delta`` into one operand of the product ``a * b`` (or ``a / b``): the
        divisor takes ``2**-delta``; a square ``a * a`` takes half of it in its one
        operand (whose fold moves both factors), and a quotient ``a / a`` carries no
        scale at all. ``states_only``: only into a state tensor."""
        operands = ((b, -1 if rule.divides else 1), (a, 1))
        if a is b:
            if rule.divides or delta % 2:
                return False
            operands, delta = ((a, 1),), delta // 2
        return any(
            isinstance(operand, Node)
            and (beneath_views(operand).op == "placeholder" or not states_only)
            and self.refold(operand, sign * delta)
            for operand, sign in operands
        )

    def _fold_number(self, node: Node, rule: ScaleRule, delta: int) -> bool:
        """Move ``2**delta`` into the product ``node``'s number operand, if it has one;
        not where the number would pass fp16's range while the product's own values fit
        it (the op would stay fp32 for its scalar alone: a runtime multiply or another
        fold carries the scale instead)."""
        for position, sign in ((rule.tensors[1], -1 if rule.divides else 1), (rule.tensors[0], 1)):
            number = argument(node, position)
            if is_number(number):
                current = self.plan.scalars.get((node, ("args", position)), number)
                if abs(current * 2.0 ** (sign * delta)) > FP16_LARGEST and self._fits(node):
                    return False
                self.scale_scalar(node, position, 2.0 ** (sign * delta))
                return True
        return False

    @staticmethod
    def _fits(node: Node) -> bool:
        """Whether ``node``'s values, as calibration saw them unscaled, fit fp16's range
        (where they do not, the op is fp32 for its range whatever its scalar)."""
        largest = observed_max_abs(node)
        return largest is not None and largest <= FP16_LARGEST

    def refold_all(self, values: list[Node], delta: int) -> bool:
        """``refold`` every one of ``values`` by ``delta``, or none of them."""
        done = []
        for value in values:
            if not self.refold(value, delta):
                for moved in done:
                    self.refold(moved, -delta)
                return False
            done.append(value)
        return bool(values)

    def lower_door(self, value: Node, reader: Node, delta: int) -> bool:
        """Scale a user input that ``reader`` alone reads ``2**delta`` further down in
        its door's multiply (or in a new one), where its largest magnitude stays at
        least ``SMALLEST_FOLDED``: no second multiply, no value pushed out of range."""
        if value.op != "placeholder" or self.state.key(value) is not None:
            return False
        if delta > 0 or list(value.users) != [reader]:
            return False
        largest = observed_max_abs(value) or 0.0
        after = self.plan.after.get(value, 0) + delta
        if largest * 2.0**after < SMALLEST_FOLDED:
            return False
        self.plan.after[value] = after
        return True

    def settle(self, operand: Node, reader: Node, target: int) -> None:
        """Bring ``operand`` to ``target`` for ``reader``: fold it, else a break."""
        delta = target - self.seen(operand)
        if delta and not self.refold(operand, delta):
            self.brk(operand, reader, delta)

    def free_refold(self, node: Node, delta: int) -> bool:
        """Move ``2**delta`` into the product ``node``'s scalar factor or a state tensor
        it alone reads (never into another value's exponent)."""
        rule = rule_of(node)
        if rule.kind is not Kind.PRODUCT:
            return False
        if self._fold_number(node, rule, delta):
            return True
        a, b = (argument(node, p) for p in rule.tensors)
        return self._fold_operands(rule, a, b, delta, states_only=True)
