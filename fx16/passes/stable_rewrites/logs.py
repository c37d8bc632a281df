"""The logarithm and exponential rewrites of ``StabilizePass``: log(softmax) as
log_softmax, log(sigmoid) split at -8, log(1 + x) as log1p, exp(x) - 1 as expm1."""

import torch
from torch.fx import Graph, Node

from fx16.meta import BOUNDED_BELOW
from fx16.passes.stable_rewrites.matching import Builder, Rewrite, calls, is_scalar, only_user

aten = torch.ops.aten


class LogSoftmax:
    """Before: ``log(softmax(x, dim))`` - probabilities below 6e-8 flush to 0 in fp16,
    and their log to -inf. After: ``log_softmax(x, dim)``, which never forms them.

    Costs: nothing; one fused op replaces two."""

    name = "log_softmax"
    roots = (aten.log.default,)  # the ops a match starts from
    marks = ()  # the meta markers its replacement writes

    def match(self, node: Node) -> Rewrite | None:
        inner = node.args[0] if calls(node, aten.log.default) else None
        if calls(inner, aten.softmax.int, aten._softmax.default) and only_user(inner, node):
            return Rewrite(node, (node, inner))
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        softmax = rewrite.result.args[0]
        x, dim = softmax.args[0], softmax.args[1]
        return Builder(graph, rewrite.result)(aten._log_softmax.default, x, dim, False)


class LogSigmoid:
    """Before: ``log(sigmoid(x))`` - sigmoid of x below -17 is 0 in fp16, its log -inf,
    and below -9.7 it is subnormal, with few bits. After: ``where(x < -8, x -
    log1p(exp(min(x, 0))), log(sigmoid(x)))``, the same function: from -8 up the model's
    own form, bit for bit (two roundings: fewer than any rewritten form there); below, a
    form whose exp cannot overflow and whose log1p keeps the small term, finite and
    accurate however negative x is.

    Costs: a comparison, a select and the rewritten form's clamp, exp, log1p and
    subtraction beside the model's two ops, elementwise in 16-bit; no fp32."""

    name = "log_sigmoid"
    roots = (aten.log.default,)  # the ops a match starts from
    marks = (BOUNDED_BELOW,)  # the meta markers its replacement writes

    def match(self, node: Node) -> Rewrite | None:
        inner = node.args[0] if calls(node, aten.log.default) else None
        if not (calls(inner, aten.sigmoid.default) and only_user(inner, node)):
            return None
        if any(_kept_from_minus_8(user, node, inner.args[0]) for user in node.users):
            return None  # the kept form in this rule's own result
        return Rewrite(node, (node, inner))

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        make = Builder(graph, rewrite.result)
        x = rewrite.result.args[0].args[0]
        tail = make(aten.exp.default, make(aten.clamp.default, x, None, 0.0))
        steep = make(aten.sub.Tensor, x, make(aten.log1p.default, tail))
        probability = make(aten.sigmoid.default, x)
        probability.meta[BOUNDED_BELOW] = _SELECTED_FROM_MINUS_8
        own = make(aten.log.default, probability)
        return make(aten.where.self, make(aten.lt.Scalar, x, -8.0), steep, own)


# Why the kept form's sigmoid cannot flush where its result is used.
_SELECTED_FROM_MINUS_8 = "read only where x >= -8, where sigmoid(x) is at least 3.3e-4"


def _kept_from_minus_8(select: Node, kept: Node, x) -> bool:
    """Whether ``select`` is ``where(x < -8, ..., kept)``: a rewritten log-sigmoid."""
    if not (calls(select, aten.where.self) and select.args[2] is kept):
        return False
    test = select.args[0]
    return calls(test, aten.lt.Scalar) and test.args[0] is x and is_scalar(test.args[1], -8.0)


class Log1p:
    """Before: ``log(x + 1)`` - for |x| below 16-bit's epsilon, 1 + x rounds to 1 and
    the result to 0. After: ``log1p(x)``, accurate for small x.

    Costs: nothing; one op replaces two."""

    name = "log1p"
    roots = (aten.log.default,)  # the ops a match starts from
    marks = ()  # the meta markers its replacement writes

    def match(self, node: Node) -> Rewrite | None:
        inner = node.args[0] if calls(node, aten.log.default) else None
        if not (calls(inner, aten.add.Tensor) and only_user(inner, node)):
            return None
        alpha = inner.kwargs.get("alpha", 1)
        if is_scalar(inner.args[1], 1) and alpha == 1 and isinstance(inner.args[0], Node):
            return Rewrite(node, (node, inner))
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        x = rewrite.result.args[0].args[0]
        return Builder(graph, rewrite.result)(aten.log1p.default, x)


class Expm1:
    """Before: ``exp(x) - 1`` - for small x, exp(x) rounds to 1 and the difference to 0
    or a multiple of 16-bit's epsilon. After: ``expm1(x)``, accurate for small x.

    Costs: nothing; one op replaces two."""

    name = "expm1"
    roots = (aten.sub.Tensor,)  # the ops a match starts from
    marks = ()  # the meta markers its replacement writes

    def match(self, node: Node) -> Rewrite | None:
        if not (calls(node, aten.sub.Tensor) and is_scalar(node.args[1], 1)):
            return None
        inner = node.args[0]
        if node.kwargs.get("alpha", 1) == 1 and calls(inner, aten.exp.default):
            if only_user(inner, node):
                return Rewrite(node, (node, inner))
        return None

    def build(self, graph: Graph, rewrite: Rewrite) -> Node:
        x = rewrite.result.args[0].args[0]
        return Builder(graph, rewrite.result)(aten.expm1.default, x)
