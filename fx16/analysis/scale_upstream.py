"""Where a product of two activations takes its scale: the weights upstream of one operand.

Attention logits ``q kᵀ`` past fp16's range (a head that attends to one token with a
huge key: an attention sink) have no state tensor of their own to fold a scale into,
and a runtime multiply after the product comes too late (the product itself
overflows). But ``q`` is a projection of the hidden state, ``q = x Wq + bq``, reshaped,
transposed, rotated (RoPE: ``q cos + rotate_half(q) sin``): every op between the
projection and the product is linear in ``q``. Carrying ``Wq`` and ``bq`` at ``2**e``
carries ``q``, and so ``q kᵀ``, at ``2**e``: the same function, with no multiply at run
time. The scale is undone after the product where the program has a free place (the
``1/sqrt(d)`` it divides by, ``fx16.analysis.scale_exponents``).

``upstream_fold(product, state, exponent)`` finds those tensors for one operand or the
other: the walk goes up through ops that commute with a scale (``Kind.SAME``) and
products by a factor that does not depend on the projection (a position's ``cos``),
to products whose weight (and bias) are state tensors read there alone, which take
``2**exponent`` and stay in fp16's normal range. Every value between them and the
product must be read only inside that path, so the scale reaches nothing else.
"""

from torch.fx import Node

from fx16.analysis.scale_plan import (
    StateTensors,
    argument,
    float_operands,
    numbers_by_keyword,
    reads_unscaled_numbers,
)
from fx16.ops.scaling import Kind, rule_of

# How many ops the walk goes up from a product before it gives up (a projection, its
# reshapes and transposes, a rotary embedding's dozen ops, a few to spare).
_DEPTH = 32


def upstream_fold(product: Node, state: StateTensors, exponent: int) -> list[Node] | None:
    """The state tensors (weights and biases) upstream of one float operand of
    ``product`` whose fold by ``2**exponent`` carries that operand at ``2**exponent``
    (see the module), and the values between them and the product, which it carries
    so too; None where neither operand has such a source."""
    rule = rule_of(product)
    if rule.divides:
        return None
    walk = _Walk(state, exponent)
    for operand in float_operands(product, rule.tensors):
        found = walk.sources(operand, 0)
        if found is not None and _contained(found[1], product):
            return sorted(set(found[0]) | found[1], key=lambda node: node.name)
    return None


Found = tuple[list[Node], set[Node]]  # the tensors to fold, the values on the way


class _Walk:
    def __init__(self, state: StateTensors, exponent: int) -> None:
        self.state, self.exponent = state, exponent

    def sources(self, node, depth: int) -> Found | None:
        """The tensors whose fold carries ``node`` at the exponent, and the values
        between them and ``node``; None where there are none."""
        if not isinstance(node, Node) or node.op != "call_function" or depth > _DEPTH:
            return None
        rule = rule_of(node)
        if rule.scalars and numbers_by_keyword(node):
            return None
        if rule.kind is Kind.SAME:
            if reads_unscaled_numbers(node, rule):
                return None
            tensors, path = [], {node}
            for operand in float_operands(node, rule.tensors):
                upstream = self.sources(operand, depth + 1)
                if upstream is None:
                    return None
                tensors += upstream[0]
                path |= upstream[1]
            return (tensors, path) if tensors else None
        if rule.kind is not Kind.PRODUCT or rule.divides:
            return None
        found = self._projection(node, rule) or self._by_a_factor(node, rule, depth)
        return (found[0], found[1] | {node}) if found else None

    def _projection(self, node: Node, rule) -> Found | None:
        """A product whose factor is a state tensor read there alone (a linear's
        weight), with its bias, when both fit at the exponent."""
        for operand in float_operands(node, rule.tensors):
            if self._foldable(operand):
                bias = argument(node, rule.bias)
                if bias is None:
                    return [operand], set()
                return ([operand, bias], set()) if self._foldable(bias, added=True) else None
        return None

    def _by_a_factor(self, node: Node, rule, depth: int) -> Found | None:
        """A product by a factor that does not carry the projection (``q * cos``): the
        one operand whose walk finds sources, with no bias to keep in step."""
        if argument(node, rule.bias) is not None:
            return None
        found = [self.sources(operand, depth + 1) for operand in float_operands(node, rule.tensors)]
        hits = [upstream for upstream in found if upstream is not None]
        return hits[0] if len(hits) == 1 else None

    def _foldable(self, node, added: bool = False) -> bool:
        """A state tensor read by one op through one name that fits at the exponent."""
        return (
            isinstance(node, Node)
            and node.op == "placeholder"
            and self.state.movable(node, self.exponent, added)
        )


def _contained(path: set[Node], product: Node) -> bool:
    """Every value on the path is read only on the path or by ``product``."""
    inside = path | {product}
    return all(user in inside for node in path for user in node.users)
