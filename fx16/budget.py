"""The accuracy budget: return the fewest ops to fp32 until the outputs are close enough.

The search compares the cast program with the fp32 program on calibration inputs,
value by value. Each round it runs the cast program once per input, measures every
node's relative error against fp32, and returns to fp32 the nodes that add the most
error themselves (their error minus the largest error of their inputs: the first
divergence, not the nodes that merely carry it on). Neighbouring nodes returned
together form connected fp32 regions, joined by casts only at their edges.
"""

import warnings
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.fx import Interpreter, Node

from fx16.analysis.calibration import CalibrationAnalysis, calibration_calls
from fx16.casts import before_inserted_casts, cast_back_source, is_inserted
from fx16.decisions import was_narrowed
from fx16.errors import InvalidOptionError
from fx16.ops import ASSERT_METADATA_OPS
from fx16.passes.insert_fp16_casts import OUTPUTS
from fx16.pipelines import fp16_passes, run_passes
from fx16.program import Program
from fx16.progress import Progress
from fx16.stats import relative_error

# Each round takes the worst node and, up to _MOST_PER_ROUND in all, the nodes whose own
# error is at least _TAKE_ALONG of the worst one's: fewer rounds, few extra fp32 ops.
_TAKE_ALONG = 0.5
_MOST_PER_ROUND = 4
_MAX_ROUNDS = 64


@dataclass(frozen=True)
class AccuracySearch:
    """What the search did: the budget, the error reached, and what it cost."""

    budget: float
    error: float
    evaluations: int  # runs of a program on one calibration input, the fp32 runs included
    rounds: int
    fp32_nodes: tuple[str, ...]

    @property
    def met(self) -> bool:
        return self.error <= self.budget


def cast_fp16_within_budget(
    ep, budget: float, calibration: list | None, progress: Progress, **options
) -> AccuracySearch:
    """Cast ``ep`` to fp16 in place, returning nodes to fp32 until the error is within budget.

    ``options`` are those of ``fx16.fp16_passes``. Warns when even the last round
    misses the budget (nothing left that adds error in 16-bit).
    """
    program = Program(ep)
    calls = calibration_calls(program, calibration)
    if not calls:
        raise InvalidOptionError(
            "max_rel_error needs inputs to measure on: pass calibration=[(args...), ...] "
            "(this program has no example inputs)"
        )
    CalibrationAnalysis(program, calibration)(ep.graph_module)
    references = [_record(program, args, kwargs) for args, kwargs in calls]
    evaluations, forced, rounds = len(calls), set(), 0
    pristine = program.snapshot()
    while True:
        rounds += 1
        if rounds > 1:
            pristine.restore()
        passes = fp16_passes(ep, calibration=calibration, force_fp32=frozenset(forced), **options)
        run_passes([p for p in passes if not isinstance(p, CalibrationAnalysis)], ep.graph_module)
        observed = [_record(program, *program.adapt_call(args, kwargs)) for args, kwargs in calls]
        evaluations += len(calls)
        error = max(_output_error(ref, obs) for ref, obs in zip(references, observed))
        progress.update(
            f"fx16 accuracy search: round {rounds}, error {error:.3g} (budget {budget:.3g}), "
            f"{len(forced)} node(s) back in fp32"
        )
        culprits = set()
        if error > budget and rounds < _MAX_ROUNDS:
            culprits = _culprits(ep.graph_module, references, observed, forced)
        if not culprits:
            break
        forced |= culprits
    progress.done()
    result = AccuracySearch(budget, error, evaluations, rounds, tuple(sorted(forced)))
    if not result.met:
        warnings.warn(
            f"fx16: the accuracy budget {budget:.3g} was not met (error {error:.3g}): "
            "no node left whose 16-bit computation adds error",
            RuntimeWarning,
            stacklevel=3,
        )
    return result


@dataclass
class _Record:
    values: dict[str, torch.Tensor]
    outputs: list


class _Recorder(Interpreter):
    def __init__(self, graph_module) -> None:
        super().__init__(graph_module)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, node: Node):
        result = super().run_node(node)
        if isinstance(result, torch.Tensor) and result.is_floating_point():
            self.values[node.name] = result.detach()
        return result


def _record(program: Program, args: tuple, kwargs: dict) -> _Record:
    recorder = _Recorder(program.graph_module)
    with torch.no_grad():
        outputs = recorder.run(*program.graph_inputs(args, kwargs, copy_buffers=True))
    return _Record(recorder.values, pytree.tree_leaves(outputs))


def _output_error(reference: _Record, observed: _Record) -> float:
    errors = [
        relative_error(ref, obs)
        for ref, obs in zip(reference.outputs, observed.outputs)
        if isinstance(ref, torch.Tensor) and ref.is_floating_point()
    ]
    return max(errors, default=0.0)


def _culprits(
    graph_module, references: list[_Record], observed: list[_Record], forced: set[str]
) -> set[str]:
    """What to return to fp32 next (never a node in ``forced`` again): the 16-bit nodes
    adding the most error themselves.

    A node's added error is its error against fp32 minus the largest error of the
    values it reads. Casts fx16 inserted are measured against the value they stand
    for; a cast back to fp16 that adds error (rounding an fp32 result) names its
    consumers instead, which then read the fp32 value: the fp32 region grows by one
    step. At the outputs, that consumer is ``OUTPUTS``. A node already returned to
    fp32 that still adds error amplifies its inputs' rounding (softmax over large
    logits): its 16-bit producers are named, and the region grows towards them.
    """

    def error(node: Node) -> float:
        name, stands_for = node.name, before_inserted_casts(node).name
        found = [
            relative_error(ref.values[stands_for], obs.values[name])
            for ref, obs in zip(references, observed)
            if stands_for in ref.values and name in obs.values
        ]
        return max(found, default=0.0)

    errors: dict[Node, float] = {}
    added: dict[str, float] = {}
    for node in graph_module.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        errors[node] = error(node)
        own = errors[node] - max((errors.get(a, 0.0) for a in node.all_input_nodes), default=0.0)
        if is_inserted(node) and cast_back_source(node, torch.float32) is not None:
            for user in node.users:
                if user.target not in ASSERT_METADATA_OPS:
                    name = OUTPUTS if user.op == "output" else user.name
                    added[name] = max(added.get(name, 0.0), own)
        elif was_narrowed(node) and not is_inserted(node):
            added[node.name] = max(added.get(node.name, 0.0), own)
        elif node.name in forced:
            # already fp32 and still adding error: it amplifies its inputs' rounding
            # (softmax of large logits), so the region grows towards them
            for arg in node.all_input_nodes:
                source = before_inserted_casts(arg)
                if was_narrowed(source):
                    added[source.name] = max(added.get(source.name, 0.0), own)
    added = {name: own for name, own in added.items() if name not in forced}
    worst = max(added.values(), default=0.0)
    if worst <= 0.0:
        return set()
    ranked = sorted(added, key=added.get, reverse=True)
    return {name for name in ranked[:_MOST_PER_ROUND] if added[name] >= _TAKE_ALONG * worst}
