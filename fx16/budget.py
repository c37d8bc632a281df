"""The accuracy budget: return the fewest ops to fp32 until the outputs are close enough.

The search compares the cast program with the fp32 program on calibration inputs.
Each round it runs the cast program once per input and measures the output error;
while over budget, one backward run of the fp32 program tells, for every use of
every value the cast program holds in 16-bit, how much that use's rounding can
move the outputs along the current error. The worst uses return to fp32 (the
consumer, reading its producer in fp32), so fp32 regions grow as connected pieces,
joined by casts only at their edges, and the other uses of a value stay 16-bit.
"""

import copy
import gc
import math
import warnings
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.fx import Node
from torch.fx.node import map_arg

from fx16.analysis.calibration import CalibrationAnalysis, calibration_calls
from fx16.casts import before_inserted_casts, is_cast, is_inserted
from fx16.decisions import was_narrowed
from fx16.errors import InvalidOptionError
from fx16.interpreter import LeanInterpreter
from fx16.nodes import node_dtype
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
_LOW = (torch.float16, torch.bfloat16)


def stopping_share(inputs: int) -> float:
    """The share of the budget the search must get below on its calibration inputs,
    so that the budget still holds on inputs it has not seen: 1 - 0.5 / sqrt(inputs),
    half the budget on one input, 75% on four, closer to all of it the more inputs
    show how the error varies. (On one input, stopping at 80% left a T5 encoder at
    0.68% error there and 1.4% on others, with a 1% budget.)"""
    return 1.0 - 0.5 / math.sqrt(max(inputs, 1))


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

    The search stops once the calibration error is below a share of ``budget`` (see
    ``stopping_share``), a margin for inputs it has not seen. ``options`` are those
    of ``fx16.fp16_passes``. Warns when the last round still misses the budget (the
    round limit was reached).
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
    target = stopping_share(len(calls)) * budget
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
        if error > target and rounds < _MAX_ROUNDS:
            # far over budget: take several nodes a round; close to it: one at a time
            most = _MOST_PER_ROUND if error > 2 * target else 1
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


class _Recorder(LeanInterpreter):
    """Runs a graph and keeps every float value by node name (detached unless asked).

    With ``keep_graph`` it also hands each consumer its own view of every float
    input, kept in ``edges`` by (producer name, consumer name), so that gradients
    tell apart how much a value matters through each of its uses."""

    def __init__(self, graph_module, keep_graph: bool = False) -> None:
        super().__init__(graph_module)
        self.keep_graph = keep_graph
        self.values: dict[str, torch.Tensor] = {}
        self.edges: dict[tuple[str, str], torch.Tensor] = {}

    def run_node(self, node: Node):
        result = super().run_node(node)
        if _is_float(result):
            self.values[node.name] = result if self.keep_graph else result.detach()
        return result

    def fetch_args_kwargs_from_env(self, node: Node):
        args, kwargs = super().fetch_args_kwargs_from_env(node)
        if not self.keep_graph:
            return args, kwargs
        views = {}
        for source in node.all_input_nodes:
            value = self.env.get(source)
            if _is_float(value) and value.requires_grad:
                views[source] = self.edges[(source.name, node.name)] = value.view_as(value)
        if views:
            args = map_arg(node.args, lambda source: views.get(source, self.env[source]))
            kwargs = map_arg(node.kwargs, lambda source: views.get(source, self.env[source]))
        return args, kwargs


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


def _gradients(reference, errors: list[list]) -> list[dict[tuple[str, str], torch.Tensor]]:
    """d L / d (value as one consumer reads it), by (producer, consumer) name, for
    every use of a float value in the fp32 program, per calibration input; with
    L = sum over outputs of <fp32 output - cast output, output>: how much each use of
    each value moves the outputs along the error the cast program makes now."""
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
            edges = list(recorder.edges)
            views = [recorder.edges[edge] for edge in edges]
            grads = torch.autograd.grad(loss, views, allow_unused=True) if views else []
        found.append({edge: g for edge, g in zip(edges, grads) if g is not None})
    return found


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _culprits(
    graph_module, reference, observed: list[_Record], forced: set[str], most: int
) -> set[str]:
    """What to return to fp32 next (never a node in ``forced`` again).

    Each use of a value stored in 16-bit (a 16-bit op's result, a 16-bit parameter or
    input, or an fp32 result cast down) is scored by the first-order effect of its
    rounding on the output error, elementwise and without cancellation:
    sum |dL/du * (v - fp16(v))| on the fp32 program, with u that consumer's view of v
    and L the outputs projected on the current error (see ``_gradients``). Summing
    signed terms instead let roundings that happen to cancel on the calibration
    inputs look harmless, and the budget then failed on other inputs.

    Removing that rounding for that use takes the consumer in fp32 (``OUTPUTS`` for a
    program output), reading the value's producer in fp32 (the producer too, when it
    computes in 16-bit); its other consumers keep reading 16-bit. The worst uses'
    remedies are returned, so fp32 regions grow as connected pieces and stop where
    the error does.
    """
    errors = [
        [
            (ref - obs.to(ref.dtype)).detach() if _is_float(ref) and _is_float(obs) else None
            for ref, obs in zip(ref_record.outputs, obs_record.outputs)
        ]
        for ref_record, obs_record in zip(reference.records, observed)
    ]
    gradients = _gradients(reference, errors)

    def impact(producer: str, consumer: str) -> float:
        total = 0.0
        for record, grads in zip(reference.records, gradients):
            value, grad = record.values.get(producer), grads.get((producer, consumer))
            if value is not None and grad is not None:
                rounding = value - value.to(torch.float16).to(value.dtype)
                total += float((grad * rounding).abs().sum())
        return total

    remedies: list[tuple[float, set[str]]] = []
    for node in graph_module.graph.nodes:
        stored = _stored_in_16_bit(node)
        if stored is None:
            continue
        producer, computes_in_16_bit = stored
        for consumer in _readers(node):
            fix = {OUTPUTS if consumer.op == "output" else consumer.name}
            if computes_in_16_bit:
                fix.add(producer.name)
            fix -= forced
            if fix:
                remedies.append((impact(producer.name, consumer.name), fix))
    worst = max((score for score, _ in remedies), default=0.0)
    if worst <= 0.0:
        return set()
    remedies.sort(key=lambda remedy: remedy[0], reverse=True)
    chosen: set[str] = set()
    for score, fix in remedies[:most]:
        if score >= _TAKE_ALONG * worst:
            chosen |= fix
    return chosen


def _stored_in_16_bit(node: Node) -> tuple[Node, bool] | None:
    """(producer, whether the producer itself computes in 16-bit) for a value the
    cast program holds in 16-bit where the fp32 program held fp32; None otherwise."""
    if node.op not in ("placeholder", "call_function"):
        return None
    if is_inserted(node) and is_cast(node):
        source = before_inserted_casts(node)
        if node_dtype(node) in _LOW and node_dtype(source) == torch.float32:
            return source, False
        return None
    if was_narrowed(node):
        return node, True
    return None


def _readers(node: Node) -> list[Node]:
    """The original nodes (or the output) that read ``node``'s value, through any
    casts fx16 inserted after it; ``_assert_tensor_metadata`` checks left out."""
    readers, pending = [], list(node.users)
    while pending:
        user = pending.pop()
        if user.target in ASSERT_METADATA_OPS:
            continue
        if is_inserted(user) and is_cast(user):
            pending.extend(user.users)
        elif user not in readers:
            readers.append(user)
    return readers
