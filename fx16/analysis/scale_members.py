"""Which values form a scale domain: grown from each value past fp16's range (or a
weight wholly below its normal range) through the ops that commute with a positive scale,
and the state tensors a product or norm reads (where the scale folds).
``fx16.analysis.scale_domains`` plans their exponents."""

import operator

from torch.fx import Node

from fx16 import meta
from fx16.analysis.scale_plan import (
    SMALLEST_NORMAL,
    beneath_views,
    first_layer_input_weights,
    float_operands,
    reads_unscaled_numbers,
)
from fx16.ops.declarations import declaration
from fx16.ops.numerics import INF_LIKE
from fx16.ops.scaling import Kind, rule_of
from fx16.program.nodes import node_val, tensor_leaves


def grow_domains(
    magnitudes: dict, limit: float, tensors: dict, fp32: set[Node]
) -> list[list[Node]]:
    """The domains grown from every value past ``limit`` (a finite, non-sentinel one),
    or below the normal range where a scale would lift it (``_small``), none holding a
    value of ``fp32`` (the model's own fp32 regions, kept)."""
    member: dict[Node, int] = {}
    groups: list[list[Node]] = []
    for seed, magnitude in magnitudes.items():
        if seed in member or seed in fp32 or meta.RANGE_SCALE in seed.meta:
            continue
        if not (limit < magnitude < INF_LIKE or (0 < magnitude < SMALLEST_NORMAL and _small(seed))):
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
            if node in fp32:
                continue
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
    folded) and a bias; an operand of a product already in a domain (the two merge); for
    a decomposed norm's output (a ``getitem`` of its tuple), the norm's weight and bias."""
    if node.op != "call_function" or not _is_float(node):
        return []
    if node.target is operator.getitem:  # a decomposed norm's output: (out, mean, rstd)
        return _norm_affine(node.args[0]) if node.args[1] == 0 else []
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
        state = [operand for operand in candidates if beneath_views(operand) in tensors]
        return state[-1:] + bias if state else []
    if rule.kind is Kind.NORM:
        return _norm_affine(node)
    if rule.kind is Kind.POWER_OF_BASE and node.args[0] == 2:
        return _logarithm_argument(node.args[1])
    return []


def _norm_affine(node) -> list[Node]:
    """The weight and bias of the norm ``node`` (where a scale on its output folds)."""
    rule = rule_of(node) if isinstance(node, Node) and node.op == "call_function" else None
    if rule is None or rule.kind is not Kind.NORM or rule.weight is None:
        return []
    return float_operands(node, (rule.weight, rule.norm_bias or rule.weight))


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


def _small(node: Node) -> bool:
    """A value below the normal range worth a domain of its own: a weight some product
    multiplies by (an RNN's first-layer input weights, a declared dequantize's scale
    too), or a product's result (a scale can fold into its factor); a tiny bias or
    addend is absorbed by what it is added to, and a stable rewrite's negligible part
    (the exact error of a product, flushing harmlessly: ``meta.negligible``) needs no
    lift (a 0.2B Llama's retargeted norms hold 497, each once grown into a domain of
    about 77 values and dropped)."""
    if meta.negligible(node):
        return False
    if node.op == "placeholder":
        return any(
            user.op == "call_function"
            and (
                rule_of(user).kind is Kind.PRODUCT
                and node in float_operands(user, rule_of(user).tensors)
                or rule_of(user).kind is Kind.RECURRENT
                and node in first_layer_input_weights(user, rule_of(user))
                or declaration(user.target) is not None  # a dequantize's scale
                and node in float_operands(user, rule_of(user).tensors)
            )
            for user in node.users
        )
    return node.op == "call_function" and rule_of(node).kind is Kind.PRODUCT
