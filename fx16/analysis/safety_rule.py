"""What a safety rule is (``SafetyRule``) and what it may read beyond its node
(``RuleContext``): the shape every rule of ``Fp32RulesAnalysis`` has."""

import functools
import math
from typing import Protocol

import torch
from torch.fx import GraphModule, Node

from fx16.decisions import Reason
from fx16.program.nodes import mutated_argument


class RuleContext:
    """What a rule reads beyond the node it is asked about: the program (``None`` for a
    graph asked on its own), the graph module being asked, and the bounds of symbolic
    sizes (the program's range constraints, as torch.export recorded them)."""

    def __init__(self, program, graph_module: GraphModule) -> None:
        self.program, self.graph_module = program, graph_module

    @functools.cached_property
    def writes(self) -> list[tuple[Node, Node]]:
        """Each op of the graph that writes an argument in place, with that argument
        (found once: a rule asked of every state tensor reads it for each)."""
        found = []
        for node in self.graph_module.graph.nodes:
            written = mutated_argument(node) if node.op == "call_function" else None
            if written is not None:
                found.append((node, written))
        return found

    @functools.cached_property
    def state_slots(self) -> dict:
        """The program's state slots by placeholder (empty without a program)."""
        slots = self.program.state_slots() if self.program is not None else []
        return {slot.placeholder: slot for slot in slots}

    @staticmethod
    def largest(size) -> int | None:
        """The largest value ``size`` (an int, or a symbolic size of a dynamic
        dimension) takes on any input the program accepts; None where nothing bounds
        it."""
        if isinstance(size, int):
            return size
        if isinstance(size, torch.SymInt):
            node = size.node
            upper = float(node.shape_env.bound_sympy(node.expr).upper)  # inf where unbounded
            return int(upper) if math.isfinite(upper) else None
        return None


class SafetyRule(Protocol):
    """A rule that keeps a node in fp32 whatever the policy asks.

    ``reason``: the cause it states (its ``fx16.decisions.REASON_SPECS`` entry says how
    the stages treat it); ``needs``: the analyses whose meta it reads (they must have
    run: ``Fp32RulesAnalysis.requires``); ``applies``: None where the rule does not
    apply, else the evidence (a detail for the report, "" for none); ``idle``, where a
    rule has it: True when it can apply to no node (a choice the caller left empty), and
    it is not asked; ``markers``, where a rule has them: the meta keys it reads, one of
    which some node of a graph must hold for the rule to apply there (an analysis's
    findings, calibration's observations); a graph holding none is not asked it. Its
    docstring
    says what it guards, with a before and after, and what it costs: the rules page
    (``reference/rules.md``) prints it.
    """

    reason: Reason
    needs: tuple[type, ...]

    def applies(self, node: Node, context: RuleContext) -> str | None: ...
