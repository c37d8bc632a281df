"""The precision rules: cancellations 16-bit rounding would spoil, and routers whose
choices decide an index.
``fx16.analysis.fp32_rules`` runs them in order."""

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from fx16 import meta
from fx16.analysis.conditioning import ConditioningAnalysis
from fx16.analysis.routing import RoutingAnalysis
from fx16.analysis.safety_rule import RuleContext
from fx16.decisions import Reason
from fx16.ops.kinds import DATA_MOVEMENT_OPS, packets
from fx16.ops.tables import CAST_OPS, NEUTRAL_SCALARS
from fx16.program.aliases import alias_group
from fx16.program.nodes import is_float_tensor, node_val


@dataclass(frozen=True)
class ConditioningRule:
    """An op the conditioning analysis found ill-conditioned, and the values it reads.
    Reads ``meta["fx16.ill_conditioned"]``.

    Before: ``x - x.mean()`` on values near 1000 with a spread of 0.1 loses every
    digit in fp16 (a condition number of 1e4). After: the subtraction and what it
    reads stay fp32 (per slice: one narrow column is judged apart from wide ones).
    Costs: elementwise ops and reductions, no product FLOPs unless a product is
    itself ill-conditioned."""

    needs = (ConditioningAnalysis,)
    markers = (meta.ILL_CONDITIONED,)
    reason = Reason.ILL_CONDITIONED

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return meta.ill_conditioned(node)


@dataclass(frozen=True)
class AccumulatingStateRule:
    """A float buffer the program writes from its own value on every call (a running
    total, ``self.total.add_(x.sum(0))``, or its functional form, a buffer mutation
    whose value reads the buffer) stays fp32. Calibration sees one call; the state
    grows with the number of calls, and in 16-bit an update below 2**-11 of the total
    rounds away.

    Before: the running mean of 10,000 calls is off by 67% in fp16, finite and silent.
    After: the buffer and the op that updates it compute in fp32; what computes the
    update stays 16-bit. Costs: one elementwise op per update, and the buffer's bytes."""

    needs = ()
    reason = Reason.ACCUMULATING_STATE

    def applies(self, node: Node, context: RuleContext) -> str | None:
        if node.op != "placeholder" or context.program is None:
            return None
        if not is_float_tensor(node_val(node)):
            return None
        writer = accumulated_by(node, context)
        if writer is None:
            return None
        calls = round(2 / torch.finfo(torch.float16).eps)
        return f"{writer} updates it; in 16-bit equal updates round away after about {calls} calls"


def accumulated_by(placeholder: Node, context: RuleContext) -> str | None:
    """The name of the op that writes ``placeholder`` (a state tensor) with a value its
    own old value reaches through arithmetic (an add, a multiply: not a copy, a fill,
    or an index or slice written over, as a cache is): an op that writes it (or a view
    of it) in place, or the value the program's signature writes back to its buffer.
    None where nothing accumulates into it."""
    group = alias_group([placeholder])
    for node, written in context.writes:
        if written in group and _accumulates(node, group):
            return node.name
    slot = context.state_slots.get(placeholder)
    if slot is None or context.graph_module is not context.program.graph_module:
        return None
    written = context.program.ep.graph_signature.buffers_to_mutate
    output = next(reversed(context.graph_module.graph.find_nodes(op="output")))
    for value in output.args[0]:
        if isinstance(value, Node) and written.get(value.name) == slot.target:
            if _accumulates(value, group):
                return value.name
    return None


def _accumulates(value: Node, sources: set[Node]) -> bool:
    """An op on a path from ``sources`` to ``value`` (``value`` included) computes
    arithmetic, so what ``value`` holds grows from what the sources held."""
    ancestors, pending = set(), [value]
    while pending:
        node = pending.pop()
        if node not in ancestors:
            ancestors.add(node)
            pending += node.all_input_nodes
    on_path, pending = set(), [node for node in sources if node in ancestors]
    while pending:
        node = pending.pop()
        if node not in on_path:
            on_path.add(node)
            pending += [user for user in node.users if user in ancestors]
    return any(
        node.op == "call_function" and _arithmetic(node.target) and not _identity(node)
        for node in on_path
    )


# In-place ops that overwrite what they write (their old values are not read back).
_OVERWRITES = packets("copy", "fill", "zero", "index_put", "index_copy", "masked_fill")


def _identity(node: Node) -> bool:
    """``node`` multiplies or divides by 1, or adds or subtracts 0 (``NEUTRAL_SCALARS``):
    its value is its first argument's, and an update by it adds nothing over the calls
    (transformers' RWKV divides its output weights in place by 2**0 on every call)."""
    name = (getattr(node.target, "_opname", "") or "").rstrip("_")
    other = node.args[1] if len(node.args) > 1 else None
    return (
        name in NEUTRAL_SCALARS
        and isinstance(other, (int, float))
        and not isinstance(other, bool)
        and other == NEUTRAL_SCALARS[name]
        and node.kwargs.get("alpha", 1) == 1
        and node.kwargs.get("rounding_mode") is None
    )


def _arithmetic(target) -> bool:
    name = (getattr(target, "_opname", "") or "").rstrip("_")
    return not (
        target in CAST_OPS
        or target is operator.getitem
        or name in DATA_MOVEMENT_OPS
        or name in _OVERWRITES
    )


@dataclass(frozen=True)
class RouterRule:
    """A router op the policy keeps in fp32 (``routing="fp32"``). Reads
    ``meta["fx16.router"]``.

    Before: a mixture-of-experts gate's top-k picks another expert when its scores
    round to 16-bit. After: the gate's product (where it costs at most 1% of the
    product FLOPs), softmax and top-k stay fp32. Costs: that small product and the
    selection; ``routing="16-bit"`` pays nothing and lets the choice change."""

    needs = (RoutingAnalysis,)
    markers = (meta.ROUTER,)
    reason = Reason.ROUTER

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return meta.routes(node)
