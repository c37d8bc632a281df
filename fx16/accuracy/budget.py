"""The accuracy budget: return the fewest ops to fp32 until the outputs are close enough.

The search compares the cast program with the fp32 program on calibration inputs.
Each evaluation runs the cast program once on every input and measures the output
error; while over budget, a backward run of the fp32 program (its autograd graph
kept from the first one; one run per bounded group of gradients) tells, for every
use of every value the cast program holds in 16-bit, how much that use's rounding
can move the outputs along the current error. The worst uses return to fp32 (the
consumer, reading its producer in fp32), so fp32 regions grow as connected pieces,
joined by casts only at their edges, and the other uses of a value stay 16-bit.

Which first: fp32 is a cost, and the search spends it where it buys the most. On a
GPU or the Neural Engine an fp32 product costs 8-16x its 16-bit time, an fp32
elementwise op about twice its bytes: so every remedy that moves no matmul/conv/
attention FLOPs to fp32 (elementwise ops, reductions) comes before any that moves a
product. Within each group a remedy's score (the error its rounding causes) is
weighed against what it costs, an elementwise op or reduction counting
``ELEMENTWISE_WEIGHT`` of its FLOPs: remedies are taken by error removed per FLOP paid.

How far: the plain cast is kept when its calibration error is within the budget by the
margin its own spread over the inputs calls for (``_Search.spread_share``); a search
stops below ``stopping_share`` of the budget, a margin for inputs it has not seen, since
its choices fit the ones it sees; the caller's ``target_share`` instead where given.

How many: the first round takes the single best remedy; a round that does not
halve the excess over the budget doubles the count for the next one, which scores
again from where the last left off, so the fp32 set grows geometrically when the
scores stall, and evaluations grow with the log of the count needed. Once within
budget, a bisection over the last round's remedies keeps the shortest prefix of
them that still meets it, and the products kept in fp32 are offered back to
16-bit, the most expensive first, while the budget still holds: the search lands
close to the budget, with as many FLOPs in 16-bit as it allows. After
``_MOST_EVALUATIONS`` every node returns to fp32, where the error is zero: the
search always ends within budget, or raises ``AccuracyBudgetError`` when even
all-fp32 misses it.
"""

import copy
import gc
import math
from dataclasses import replace

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import Node
from tqdm import tqdm

from fx16.accuracy import remedies as budget_remedies
from fx16.accuracy.metrics import relative
from fx16.accuracy.metrics import resolve as resolve_metric
from fx16.accuracy.remedies import Reference, names, reference_outputs
from fx16.accuracy.search import AccuracySearch
from fx16.analysis.calibration_inputs import calibration_calls
from fx16.analysis.verdict_check import VerdictCheckAnalysis
from fx16.errors import (
    AccuracyBudgetError,
    Fx16Error,
    InvalidOptionError,
    PassFailedError,
    require_number,
)
from fx16.passes.insert_fp16_casts import OUTPUTS
from fx16.pipelines import fp16_stages, run_passes
from fx16.policy.options import Fp16Options
from fx16.program import Program
from fx16.program.cost import flops, is_product
from fx16.program.stats import program_stats

# Evaluations after which the search returns every node to fp32 at once.
_MOST_EVALUATIONS = 36
# Products kept in fp32 offered back to 16-bit once the budget is met, at most.
_GIVE_BACK = 6


def stopping_share(inputs: int) -> float:
    """The share of the budget the search must get below on its calibration inputs,
    so that the budget still holds on inputs it has not seen: 1 - 0.5 / sqrt(inputs),
    half the budget on one input, 75% on four, closer to all of it the more inputs
    show how the error varies. (On one input, stopping at 80% left a T5 encoder at
    0.68% error there and 1.4% on others, with a 1% budget.)"""
    return 1.0 - 0.5 / math.sqrt(max(inputs, 1))


def cast_fp16_within_budget(
    ep,
    budget: float,
    calibration: list | None,
    progress: bool | None,
    target_share: float | None = None,
    options: Fp16Options | None = None,
    metric=None,
    validation: list | None = None,
) -> AccuracySearch:
    """Cast ``ep`` to fp16 in place, returning nodes to fp32 until the error is within budget.

    The plain cast is kept when its calibration error is within ``target_share`` of
    ``budget`` (None: within the share ``_Search.spread_share`` estimates from how its
    error spreads over the calibration inputs: the plain cast was not chosen to fit
    them, so an unseen input is one more draw). Otherwise the search
    stops once the calibration error is below ``target_share`` of the budget (None:
    ``stopping_share``, a margin for inputs it has not seen: its choices were fitted
    to these inputs, and fit unseen ones less well). ``options``: the cast's
    (its ``calibration`` is ``calibration``). ``metric``: what the errors measure, a
    preset name or a callable (``fx16.accuracy.metrics``; default "rel"). ``validation``: inputs
    the search never uses; the error on them is reported beside the calibration error.
    Raises ``AccuracyBudgetError`` when every remedy is taken and the error is still over
    that share (the caller's transaction then restores the program). ``progress``: a
    progress bar of the evaluations on stderr (None: when stderr is a terminal).
    """
    program = Program.of(ep)
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
    if target_share is not None:
        require_number("target_share", target_share, 0, strict=True)
        if target_share > 1:
            raise InvalidOptionError(f"target_share must be at most 1, got {target_share!r}")
    options = replace(options or Fp16Options(), calibration=calibration)
    # once: what they find does not depend on the fp32 set
    run_passes(fp16_stages(ep, options).before_decisions, ep.graph_module)
    target = None if target_share is None else target_share * budget
    targets = (target, target)  # None: estimated from the calibration inputs
    metric_name, measure = resolve_metric(metric)
    held_out = calibration_calls(program, validation, label="validation") if validation else []
    search = _Search(program, calls, calibration, budget, targets, progress, options)
    search.metric, search.metric_name = measure, metric_name
    search.validation = held_out, [search.reference_outputs(call) for call in held_out]
    try:
        return search.run()
    except Fx16Error:
        raise
    except Exception as error:
        raise PassFailedError("accuracy search", error, restored=False) from error
    finally:
        search.progress.close()


class _Search:
    """One budget search: the reference, the current fp32 set, and the counts."""

    def __init__(self, program, calls, calibration, budget, targets, progress, options) -> None:
        """``targets``: the error the plain cast must reach to be kept, and the one a
        search aims at (see ``cast_fp16_within_budget``)."""
        self.program, self.calls, self.calibration = program, calls, calibration
        self.budget, self.options = budget, options
        self.plain_target, self.target = targets
        self.progress = tqdm(
            total=_MOST_EVALUATIONS,
            desc="fx16 accuracy search",
            unit=" evaluations",
            leave=False,
            disable=None if progress is None else not progress,
        )
        inputs = [program.graph_inputs(args, kwargs, copy_buffers=True) for args, kwargs in calls]
        reference_module = copy.deepcopy(program.ep.graph_module)
        buffers = {
            slot.placeholder.name for slot in program.state_slots() if slot.kind == InputKind.BUFFER
        }
        self.reference = Reference(
            reference_module,
            inputs,
            [reference_outputs(reference_module, each) for each in inputs],
            buffers,
        )
        self.pristine = program.snapshot()
        self.names = {
            node.name
            for node in program.ep.graph_module.graph.nodes
            if node.op in ("placeholder", "call_function")
        }
        self.evaluations = self.rounds = 0
        self.metric, self.metric_name = relative, "rel"
        self.validation: tuple[list, list] = ([], [])  # calls and their fp32 outputs
        specs = program.ep.graph_signature.output_specs
        self.user_positions = [
            i for i, spec in enumerate(specs) if spec.kind == OutputKind.USER_OUTPUT
        ]
        self.holds: set[str] | None = None  # the fp32 set the program is cast with now
        self.answers: dict = {}  # VerdictCheckAnalysis's, measured on the first cast only

    def cast(self, forced: set[str]) -> None:
        """Cast the pristine program with ``forced`` kept in fp32."""
        ep = self.program.ep
        if self.holds is not None:
            self.pristine.restore()
            gc.collect()  # the last round's graph (the transaction pauses the collector)
        self.holds = set(forced)
        passes = fp16_stages(ep, replace(self.options, fallback=frozenset(forced))).from_decisions
        for stage in passes:
            if isinstance(stage, VerdictCheckAnalysis):
                stage.answers = self.answers  # each kind of verdict measured once
        run_passes(passes, ep.graph_module)  # the analyses' findings came with the snapshot

    def measure(self, forced: set[str]) -> tuple[float, list]:
        """Cast with ``forced`` in fp32 and run it on every input: (error, outputs)."""
        self.cast(forced)
        self.evaluations += 1
        outputs = self.run_cast(self.calls)
        error = self.error(self.reference.outputs, outputs)
        self.progress.set_postfix_str(
            f"error {error:.3g} (budget {self.budget:.3g}), {len(forced)} node(s) in fp32"
        )
        self.progress.update()
        return error, outputs

    def run_cast(self, calls: list) -> list[list]:
        """The cast program's flat graph outputs on each call."""
        graph_module, outputs = self.program.ep.graph_module, []
        with torch.no_grad():
            for args, kwargs in calls:
                inputs = self.program.graph_inputs(*self.program.adapt_call(args, kwargs))
                outputs.append(pytree.tree_leaves(graph_module(*inputs)))
        return outputs

    def reference_outputs(self, call) -> list:
        """The fp32 program's flat graph outputs on ``call`` (run before any change)."""
        inputs = self.program.graph_inputs(*call, copy_buffers=True)
        return reference_outputs(self.reference.graph_module, inputs)

    def error(self, reference: list[list], outputs: list[list]) -> float:
        """The metric over the user outputs of every call."""

        def users(per_call: list[list]) -> list[list]:
            return [[flat[i] for i in self.user_positions] for flat in per_call]

        return float(self.metric(users(reference), users(outputs)))

    def validate(self) -> float | None:
        calls, reference = self.validation
        return self.error(reference, self.run_cast(calls)) if calls else None

    def run(self) -> AccuracySearch:
        forced: set[str] = set()
        error, outputs = self.measure(forced)
        plain_error = error
        if self.plain_target is None:
            self.plain_target = self.spread_share(outputs) * self.budget
        if self.target is None:
            self.target = stopping_share(len(self.calls)) * self.budget
        count, last_round = 1, []
        while error > (self.plain_target if not self.rounds else self.target):
            self.rounds += 1
            remedies = budget_remedies.remedies(
                self.program.ep.graph_module, self.reference, outputs, forced
            )
            if not remedies or self.evaluations >= _MOST_EVALUATIONS:
                forced, error = self.everything(forced, error)
                last_round = []
                break
            last_round = remedies[:count]
            new_error, outputs = self.measure(forced | names(last_round))
            if new_error - self.target > 0.5 * (error - self.target):
                count *= 2  # fell short: take twice as many next round
            forced, error = forced | names(last_round), new_error
        if len(last_round) > 1:
            forced, error = self.shortest_prefix(last_round, forced - names(last_round), error)
        if last_round:
            forced, error = self.give_back(forced, error)
        return AccuracySearch(
            self.budget,
            error,
            self.evaluations,
            self.rounds,
            tuple(sorted(forced)),
            program_stats(self.program.ep).flop_share_16bit,
            self.plain_target if not self.rounds else self.target,
            plain_error,
            self.metric_name,
            self.validate(),
        )

    def spread_share(self, outputs: list[list]) -> float:
        """The share of the budget the plain cast must meet on the calibration inputs to
        be kept: nothing was fitted to them, so an unseen input is one more draw, and may
        exceed the worst of them by as much as one of them exceeds the worst of the
        others (leave each out in turn: the smallest ratio of the others' worst error to
        its own, at most 1). One input has nothing to compare with: the budget itself."""
        if len(outputs) < 2:
            return 1.0
        errors = [
            self.error([reference], [observed])
            for reference, observed in zip(self.reference.outputs, outputs)
        ]
        share = 1.0
        for index, error in enumerate(errors):
            others = max(errors[:index] + errors[index + 1 :])
            if error > others:
                share = min(share, others / error)
        return share

    def shortest_prefix(self, remedies: list, before: set[str], error: float):
        """The last round took ``remedies`` at once (adding them to ``before`` gave
        ``error``): bisect for the shortest prefix of them that still meets the
        target, to within an eighth. Returns (fp32 set, error); the program is left
        cast with that set."""
        failed, found = 0, len(remedies)
        while found - failed > 1:
            middle = (failed + found) // 2
            trial_error, _ = self.measure(before | names(remedies[:middle]))
            if trial_error <= self.target:
                found, error = middle, trial_error
            else:
                failed = middle
        best = before | names(remedies[:found])
        if self.holds != best:
            self.cast(best)
        return best, error

    def give_back(self, forced: set[str], error: float) -> tuple[set[str], float]:
        """Offer the products in ``forced`` back to 16-bit, the most expensive first
        (at most ``_GIVE_BACK``), keeping each return that still meets the target.
        Returns (fp32 set, error); the program is left cast with that set."""
        nodes = {n.name: n for n in self.pristine_nodes() if n.name in forced and is_product(n)}
        best = set(forced)
        for name in sorted(nodes, key=lambda name: flops(nodes[name]), reverse=True)[:_GIVE_BACK]:
            if self.evaluations >= _MOST_EVALUATIONS:
                break
            trial_error, _ = self.measure(best - {name})
            if trial_error <= self.target:
                best, error = best - {name}, trial_error
        if self.holds != best:
            self.cast(best)
        return best, error

    def pristine_nodes(self) -> list[Node]:
        """The nodes of the reference (fp32) program, with their shapes."""
        return list(self.reference.graph_module.graph.nodes)

    def everything(self, forced: set[str], error: float) -> tuple[set[str], float]:
        """Every node in fp32, the last resort; raises when even that misses the target
        (the caller's constraints keep something 16-bit, or the budget is below the
        fp32 program's own run-to-run noise)."""
        everything = forced | self.names | {OUTPUTS}
        if everything != forced:
            error, _ = self.measure(everything)
        if error > self.target:
            raise AccuracyBudgetError(
                f"the accuracy budget {self.budget:.3g} cannot be met: with every node "
                f"fx16 may return to fp32 in fp32, the error is {error:.3g} (over "
                f"{self.target:.3g}, the share of the budget kept for unseen inputs)"
            )
        return everything, error
