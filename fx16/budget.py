"""The accuracy budget: return the fewest ops to fp32 until the outputs are close enough.

The search compares the cast program with the fp32 program on calibration inputs,
value by value. Each round it runs the cast program once per input, measures every
node's relative error against fp32, and returns to fp32 the nodes that add the most
error themselves (their error minus the largest error of their inputs: the first
divergence, not the nodes that merely carry it on). Neighbouring nodes returned
together form connected fp32 regions, joined by casts only at their edges.
"""

import copy
import gc
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

# Far over budget, a round takes the worst node and, up to _MOST_PER_ROUND in all, the
# nodes scoring at least _TAKE_ALONG of the worst one's: fewer rounds, few extra fp32 ops.
_TAKE_ALONG = 0.5
_MOST_PER_ROUND = 4
_MAX_ROUNDS = 64
# The search stops below this share of the budget on the calibration inputs, so the
# budget still holds on inputs it has not seen.
_TARGET = 0.8


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

    The search stops once the calibration error is below 80% of ``budget``, a margin
    for inputs it has not seen. ``options`` are those of ``fx16.fp16_passes``. Warns
    when the last round still misses the budget (the round limit was reached).
    """
    program = Program(ep)
    calls = calibration_calls(program, calibration)
    if not calls:
        raise InvalidOptionError(
            "max_rel_error needs inputs to measure on: pass calibration=[(args...), ...] "
            + (
                "(calibration=[] gives none)"
                if calibration is not None
                else "(this program has no example inputs)"
            )
        )
    CalibrationAnalysis(program, calibration)(ep.graph_module)
    inputs = [program.graph_inputs(args, kwargs, copy_buffers=True) for args, kwargs in calls]
    reference_module = copy.deepcopy(ep.graph_module)
    reference = _Reference(
        reference_module, inputs, [_record(reference_module, each) for each in inputs]
    )
    evaluations, forced, rounds = len(calls), set(), 0
    pristine = program.snapshot()
    while True:
        rounds += 1
        if rounds > 1:
            pristine.restore()
            gc.collect()  # the last round's graph (the transaction pauses the collector)
        passes = fp16_passes(ep, calibration=calibration, force_fp32=frozenset(forced), **options)
        run_passes([p for p in passes if not isinstance(p, CalibrationAnalysis)], ep.graph_module)
        observed = [
            _record(ep.graph_module, program.graph_inputs(*program.adapt_call(args, kwargs)))
            for args, kwargs in calls
        ]
        evaluations += len(calls)
        error = max(_output_error(ref, obs) for ref, obs in zip(reference.records, observed))
        progress.update(
            f"fx16 accuracy search: round {rounds}, error {error:.3g} (budget {budget:.3g}), "
            f"{len(forced)} node(s) back in fp32"
        )
        culprits = set()
        if error > _TARGET * budget and rounds < _MAX_ROUNDS:
            # far over budget: take several nodes a round; close to it: one at a time
            most = _MOST_PER_ROUND if error > 2 * _TARGET * budget else 1
            culprits = _culprits(ep.graph_module, reference, observed, forced, most)
            evaluations += len(calls)  # the gradient run of the fp32 program
        if not culprits:
            break
        forced |= culprits
    progress.done()
    result = AccuracySearch(budget, error, evaluations, rounds, tuple(sorted(forced)))
    if not result.met:
        warnings.warn(
            f"fx16: the accuracy budget {budget:.3g} was not met (error {error:.3g}): "
            f"the search stopped after {rounds} rounds",
            RuntimeWarning,
            stacklevel=3,
        )
    return result


@dataclass
class _Record:
    values: dict[str, torch.Tensor]
    outputs: list


class _Recorder(Interpreter):
    """Runs a graph and keeps every float value by node name (detached unless asked)."""

    def __init__(self, graph_module, keep_graph: bool = False) -> None:
        super().__init__(graph_module)
        self.keep_graph = keep_graph
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, node: Node):
        result = super().run_node(node)
        if _is_float(result):
            self.values[node.name] = result if self.keep_graph else result.detach()
        return result


def _record(graph_module, inputs: list) -> _Record:
    recorder = _Recorder(graph_module)
    with torch.no_grad():
        outputs = recorder.run(*inputs)
    return _Record(recorder.values, pytree.tree_leaves(outputs))


@dataclass
class _Reference:
    """The fp32 program, kept aside: its graph, inputs per call, and recorded values."""

    graph_module: object
    inputs: list[list]
    records: list[_Record]


def _output_error(reference: _Record, observed: _Record) -> float:
    errors = [
        relative_error(ref, obs)
        for ref, obs in zip(reference.outputs, observed.outputs)
        if isinstance(ref, torch.Tensor) and ref.is_floating_point()
    ]
    return max(errors, default=0.0)


def _gradients(reference, errors: list[list]) -> list[dict[str, torch.Tensor]]:
    """d L / d value for every float value of the fp32 program, per calibration input,
    where L = sum over outputs of <fp32 output - cast output, output>: how much each
    value moves the outputs along the error the cast program makes now."""
    found = []
    for inputs, output_errors in zip(reference.inputs, errors):
        recorder = _Recorder(reference.graph_module, keep_graph=True)
        with torch.enable_grad():
            leaves = [x.detach().clone().requires_grad_() if _is_float(x) else x for x in inputs]
            outputs = pytree.tree_leaves(recorder.run(*leaves))
            loss = sum(
                (out * error).sum()
                for out, error in zip(outputs, output_errors)
                if error is not None and _is_float(out) and out.requires_grad
            )
            names = [n for n, v in recorder.values.items() if v.requires_grad]
            values = [recorder.values[n] for n in names]
            grads = torch.autograd.grad(loss, values, allow_unused=True) if values else []
        found.append({n: g for n, g in zip(names, grads) if g is not None})
    return found


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _culprits(
    graph_module, reference, observed: list[_Record], forced: set[str], most: int
) -> set[str]:
    """What to return to fp32 next (never a node in ``forced`` again).

    Each value stored in 16-bit (a 16-bit op's result, or an fp32 result cast back)
    is scored by the first-order effect of its rounding on the output error:
    |sum dL/dv * (v - fp16(v))| on the fp32 program, with L the outputs projected on
    the current error (see ``_gradients``). Removing that rounding takes its producer
    and its consumers in fp32 (``OUTPUTS`` for the program outputs): the worst
    values' remedies are returned, so fp32 regions grow as connected pieces.
    """
    errors = [
        [
            (ref - obs.to(ref.dtype)).detach() if _is_float(ref) and _is_float(obs) else None
            for ref, obs in zip(ref_record.outputs, obs_record.outputs)
        ]
        for ref_record, obs_record in zip(reference.records, observed)
    ]
    gradients = _gradients(reference, errors)

    def impact(name: str) -> float:
        total = 0.0
        for record, grads in zip(reference.records, gradients):
            value, grad = record.values.get(name), grads.get(name)
            if value is not None and grad is not None:
                rounding = value - value.to(torch.float16).to(value.dtype)
                total += abs(float((grad * rounding).sum()))
        return total

    # Every value stored in 16-bit, with what removing its rounding takes: its producer
    # (if that computes in 16-bit) and its consumers must all run in fp32.
    remedies: dict[str, tuple[float, set[str]]] = {}
    for node in graph_module.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        if is_inserted(node) and cast_back_source(node, torch.float32) is not None:
            producer, fix = before_inserted_casts(node), set()
        elif was_narrowed(node) and not is_inserted(node):
            producer, fix = node, {node.name}
        else:
            continue
        fix |= {
            OUTPUTS if user.op == "output" else user.name
            for user in node.users
            if user.target not in ASSERT_METADATA_OPS and not is_inserted(user)
        }
        fix -= forced
        if fix:
            remedies[node.name] = (impact(producer.name), fix)
    worst = max((score for score, _ in remedies.values()), default=0.0)
    if worst <= 0.0:
        return set()
    ranked = sorted(remedies.values(), key=lambda remedy: remedy[0], reverse=True)
    chosen: set[str] = set()
    for score, fix in ranked[:most]:
        if score >= _TAKE_ALONG * worst:
            chosen |= fix
    return chosen
