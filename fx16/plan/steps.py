"""The fp16 cast inserter's plan: every node's precision, and what each value becomes.

``fx16.plan.planner`` builds a ``Plan`` for a graph without changing it: one ``Step`` per
op it decides (the precedence rule's ``Choice``, the decision the node will record,
its value once rewritten, whether its consumers read a 16-bit copy, the casts that
put back a model's decomposed fp32 cast), and one nested plan per body of a
higher-order op. ``fx16.passes.insert_fp16_casts`` then applies it in one walk
(``fx16.passes.fp16_rewrite``), deciding nothing on the way.

A plan answers what each consumer will read (``Plan.read``): the value and decision a
step leaves, the 16-bit copy of a value cast back after an fp32 op, the source of a
model's fp32 cast for the consumers outside the region it opens. ``str(plan)`` prints
it, one line per step.

Applied, each decided node keeps its step as plain data (``Planned``, in
``meta["fx16.planned"]`` beside its decision in ``meta["fx16.precision"]``): the report,
the HTML page and ``fx16.diagnose`` read the plan from there.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from fx16 import meta
from fx16.decisions import Decision, Reason, decision_of
from fx16.decisions import decision as make_decision
from fx16.program.casts import retype_val
from fx16.program.nodes import node_val

FP32 = torch.float32


class Read:
    """What a consumer reads of one input: its value (a fake tensor, or a tuple of
    them), its decision, and for a 16-bit copy of an fp32 value, the fp32 value's own
    ``Read`` (``source``: where widening it again leads)."""

    __slots__ = ("val", "decision", "source", "name")

    def __init__(self, val: Any, decision: Decision | None, name: str, source=None) -> None:
        self.val, self.decision, self.name, self.source = val, decision, name, source

    @property
    def dtype(self) -> torch.dtype | None:
        return self.val.dtype if isinstance(self.val, torch.Tensor) else None

    @property
    def narrowed(self) -> bool:
        return self.decision is not None and self.decision.narrowed

    @property
    def island(self) -> bool:
        """Kept fp32 as part of a region the model asks for explicitly."""
        return self.decision is not None and self.decision.reason == Reason.EXPLICIT_FP32


def explained(node: Node) -> str:
    """The node's decision as text with what its step adds where a precedence rule
    chose ("activation_overflow: observed 2.4e+05 (chosen by safety_rule; no
    cast-back: ...)"); "" for none. A getitem's step (no rule) adds nothing: saving a
    program keeps no text of its own for a getitem, which takes its op's on loading."""
    decision = decision_of(node)
    if decision is None:
        return ""
    planned = meta.planned(node)
    key = (id(decision), id(planned))
    found = _EXPLAINED.get(key)
    if found is not None and found[0] is decision and found[1] is planned:
        return found[2]
    if planned is None or not planned.rule:
        said = decision.said()
    else:
        extra = planned.said(decision.reason.name.lower())
        said = decision.said() + (f" ({extra})" if extra else "")
    shared = decision is make_decision(decision.dtype, decision.reason)  # no detail, shared
    if shared and (planned is None or planned is _PLAIN_PLANNED.get(planned.rule)):
        _EXPLAINED[key] = (decision, planned, said)  # shared records: a few, said once
    return said


# The text of each (plain decision, plain planned step) pair said so far: most nodes of a
# program share one of a few such pairs (``decision`` and ``Step.planned`` share them).
_EXPLAINED: dict[tuple[int, int], tuple] = {}


def graph_read(arg: Node) -> Read:
    """What ``arg`` holds in the graph as it is now."""
    return Read(node_val(arg), decision_of(arg), arg.name)


@dataclass(frozen=True, slots=True)
class Planned:
    """What a node's step planned, kept on the node once applied: the precedence rule
    that chose (``fx16.plan.precedence``; "" for a node no rule list decides), the fp32
    inputs it reads through a cast to 16-bit (by name), and whether its consumers read
    a 16-bit copy of its fp32 result (``cast_back``) or, where the plan skips that
    copy, why (``cast_back_skipped``). Plain data: it is copied and pickled with the
    node."""

    rule: str = ""
    narrowed_inputs: tuple[str, ...] = ()
    cast_back: bool = False
    cast_back_skipped: str = ""

    def said(self, reason: str = "") -> str:
        """ "chosen by safety_rule; no cast-back: observed 7e+04", or "": the rule is
        left out where it has the name of the decision's ``reason``."""
        parts = [f"chosen by {self.rule}"] if self.rule and self.rule != reason else []
        if self.narrowed_inputs:
            parts.append("reads " + ", ".join(self.narrowed_inputs) + " narrowed")
        if self.cast_back:
            parts.append("consumers read a 16-bit copy")
        elif self.cast_back_skipped:
            parts.append(f"no cast-back: {self.cast_back_skipped}")
        return "; ".join(parts)


_PLAIN_PLANNED: dict[str, Planned] = {}


@dataclass(slots=True)
class Step:
    """One node's planned precision (see the module docstring). ``choice`` is None for
    a node no precedence list decides (a getitem, an in-place op, a higher-order op,
    a dtype check)."""

    choice: Any  # fx16.plan.precedence.Choice | None
    decision: Decision | None
    val: Any
    cast_back: Decision | None = None  # its consumers read a 16-bit copy so decided
    cast_back_skipped: str = ""  # why they read it in fp32 instead
    arguments: tuple = ()  # ((location, value), ...): rounded scalars, 16-bit dtypes
    narrowed_inputs: tuple = ()  # fp32 inputs read through a cast to 16-bit
    widest: torch.dtype | None = None  # a promoting op's inputs widen to it first
    region: frozenset[str] | None = None  # a model's fp32 cast that opens a kept region
    restored: tuple | None = None  # a dtype check: (dtype, decision, readers) of its cast
    bodies: tuple = ()  # a higher-order op: the plan of each body
    entries: tuple = ()  # a higher-order op: each body's placeholder reads
    carried: dict | None = None  # while_loop: output index -> dtype
    wide_operands: tuple = ()  # cond / loops / map: the operands fed fp32, by index
    outputs: tuple = ()  # cond / map: (body, output index) pairs widened to fp32
    operand_dtypes: tuple = ()  # invoke_subgraph: each operand cast to its placeholder's

    def planned(self) -> Planned:
        """The step as plain data (one shared record per rule where it is all there is)."""
        rule = self.choice.rule if self.choice is not None else ""
        if self.narrowed_inputs or self.cast_back is not None or self.cast_back_skipped:
            return Planned(
                rule,
                tuple(arg.name for arg in self.narrowed_inputs),
                self.cast_back is not None,
                self.cast_back_skipped,
            )
        plain = _PLAIN_PLANNED.get(rule)
        if plain is None:
            plain = _PLAIN_PLANNED[rule] = Planned(rule)
        return plain

    def describe(self) -> str:
        said = self.decision.said() if self.decision is not None else "no decision"
        dtype = str(self.decision.dtype).removeprefix("torch.") if self.decision else "-"
        reason = self.decision.reason.name.lower() if self.decision is not None else ""
        planned = self.planned().said(reason)
        return f"{dtype:8} {said}" + (f" ({planned})" if planned else "")


class Plan:
    """The steps of one graph (``graph_module``) and the reads its consumers get."""

    def __init__(self, graph_module: GraphModule, entries: dict[Node, Read] | None = None):
        self.graph_module = graph_module
        self.steps: dict[Node, Step] = {}
        self.entries = entries or {}  # a body's placeholders: what its operands give them
        self.redirects: dict[tuple[Node, Node], Read] = {}  # (consumer, input) -> read
        self.reads: dict[Node, Read] = {}
        self.checks: list[Node] = []  # the dtype checks with no step: kept equal to their value
        self.output_dtypes: dict[int, torch.dtype] = {}  # outputs given back these dtypes
        self.fp32_outputs = False  # outputs computed in fp32 return in fp32 (no cast-back)
        self.low: torch.dtype | None = None

    def read(self, arg: Node, consumer: Node | None = None) -> Read:
        """What ``consumer`` will read of its input ``arg`` once the plan is applied."""
        if consumer is not None and self.redirects:
            redirected = self.redirects.get((consumer, arg))
            if redirected is not None:
                return redirected
        found = self.reads.get(arg)
        if found is None:
            found = self.entries.get(arg) or graph_read(arg)
            self.reads[arg] = found
        return found

    def add(self, node: Node, step: Step) -> None:
        """Record ``node``'s step and what its consumers read from now on."""
        self.steps[node] = step
        own = Read(step.val, step.decision, node.name)
        if step.cast_back is not None:
            self.reads[node] = Read(retype_val(step.val, self.low), step.cast_back, node.name, own)
        else:
            self.reads[node] = own

    def widened(self, arg: Node, consumer: Node) -> Read:
        """What ``consumer`` reads of ``arg`` once a narrowed 16-bit ``arg`` is widened to
        fp32: the fp32 value a cast-back copied, else an upcast of it."""
        read = self.read(arg, consumer)
        if not read.narrowed or read.dtype != self.low:
            return read
        if read.source is not None:
            return read.source
        return Read(retype_val(read.val, FP32), None, arg.name)

    def __str__(self) -> str:
        lines = []
        for node, step in self.steps.items():
            lines.append(f"{node.name:24} {step.describe()}")
            for body in step.bodies:
                lines += ["    " + line for line in str(body).splitlines()]
        if self.output_dtypes:
            kept = ", ".join(
                f"{index}: {str(dtype).removeprefix('torch.')}"
                for index, dtype in sorted(self.output_dtypes.items())
            )
            lines.append(f"{'outputs':24} keep their dtypes ({kept})")
        if self.fp32_outputs:
            lines.append(f"{'outputs':24} computed in fp32 return in fp32")
        return "\n".join(lines)
