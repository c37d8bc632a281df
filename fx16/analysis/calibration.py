"""CalibrationAnalysis: how large each value gets when the program runs."""

import math
import warnings

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.calibration_inputs import calibration_calls
from fx16.analysis.facts import Facts
from fx16.analysis.magnitudes import MagnitudeRecorder
from fx16.analysis.size_growth import calibrated_sizes, size_growth
from fx16.contracts import Analysis
from fx16.errors import InvalidOptionError, one_line
from fx16.ops.numeric_tables import SINGULAR_AT_ZERO
from fx16.ops.scaling import Kind, rule_of
from fx16.ops.tables import SENTINEL_ABSORBING_OPS, SENTINEL_PASSING_OPS, per_op
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from fx16.program.casts import cast_dtype, is_cast, represents_exactly, source_dtype

_OBSERVED = "observed on"  # how a status that observed the program begins


def observed(status: str) -> bool:
    """Whether a calibration status (``meta["fx16.calibration"]``, kept through save
    and load) says the program was observed on some input, not skipped."""
    return str(status).startswith(_OBSERVED)


class CalibrationAnalysis(Analysis):
    """Run the program on calibration inputs and record how large each value gets.

    Reads: the program's state and ``calibration`` (a list of argument tuples, or
    ``(args, kwargs)`` pairs); by default the example inputs torch.export recorded.
    Writes: ``node.meta["fx16.observed_range"]``, the largest finite magnitude any
    float tensor of the node held on any input, leaving out infinity-like
    sentinels (|v| >= 1e38, such as ``finfo.min`` masks) where every use tolerates
    them saturating to +-65504 (softmax, exp, comparisons, attention masks, passed
    on by add/where/masked_fill/data movement). Elsewhere a sentinel counts as an
    overflow (recorded as inf), since fp16 cannot carry its value. Also
    ``node.meta["fx16.observed_int_range"]``, the (min, max) an integer tensor held
    (seen, not proven: ValueRangeAnalysis marks it observed). When there is nothing
    to run on, writes nothing and says so in ``graph_module.meta["fx16.calibration"]``;
    otherwise ``graph_module.meta["fx16.calibration_outputs"]`` holds the program's
    outputs on each input (the fp32 reference VerdictCheckAnalysis measures against).
    And ``node.meta["fx16.observed_interval"]``, the signed (min, max) of the finite
    values a float tensor held, sentinels left out (for the conditioning of exp and
    log, which depends on sign and distance from 1; e^(-1e38) is 0 in any
    precision), with ``node.meta["fx16.observed_sentinel"]`` True where it held one.
    For the ops that subtract a mean inside (``fx16.analysis.centering``: norms, var,
    std), ``node.meta["fx16.observed_centering"]``: their input's cancellation ratio,
    max |x| / max |x - mean| over each group, the largest seen. For the values an op
    singular at zero reads there (a log's argument, a divisor:
    ``fx16.ops.tables.SINGULAR_AT_ZERO``), and for the products and powers of the
    top-level graph (a scale domain adds their operands' exponents),
    ``node.meta["fx16.observed_smallest"]``: the smallest nonzero magnitude seen.
    A value that grows with a dynamic size (a sum over the tokens) is judged at the
    size's bound (``fx16.analysis.size_growth``): its largest magnitude and interval are
    what calibration saw times the growth, ``node.meta["fx16.size_growth"]`` says by how
    much, why and what was seen, ``graph_module.meta["fx16.dynamic_lengths"]`` names the lengths.

    Facts cross the boundaries of higher-order ops (``fx16.program.boundaries``): a body's
    nodes are observed where the body ran (cond's branch taken, every iteration of a
    loop, every slice of a map), and a body's placeholder that no run reached (the
    branch not taken) has what its operands held, and so has an exact cast of a value no
    run reached (the casts an earlier cast put in that branch: cast again, it reads as
    it did).

    A run replaces what an earlier one observed (a program cast before, or calibrated on
    other inputs): every node's observations are dropped before this run's are written.

    Run it before anything converts the program: it observes the values the
    original precision computes. Buffers the program updates in place are copied
    first, so calibrating changes no state. Calibration inputs the program fails on
    raise ``InvalidOptionError`` naming the input and the program's complaint. Only
    when the example inputs torch.export recorded fail (some exports record dtypes
    their own graph does not compute) is calibration skipped, with a RuntimeWarning
    and the reason in ``graph_module.meta["fx16.calibration"]``.
    """

    META_KEY = meta.OBSERVED_MAX_ABS
    INTERVAL_KEY = meta.OBSERVED_INTERVAL
    SENTINEL_KEY = meta.OBSERVED_SENTINEL
    CENTERING_KEY = meta.OBSERVED_CENTERING
    SMALLEST_KEY = meta.OBSERVED_SMALLEST
    OUTPUTS_KEY = meta.CALIBRATION_OUTPUTS
    INT_RANGE_KEY = meta.OBSERVED_INT_RANGE
    STATUS_KEY = meta.CALIBRATION_STATUS

    def __init__(self, program: Program, calibration: list | None = None) -> None:
        self.program = Program.of(program)
        self.calibration = calibration

    @classmethod
    def observed(cls, graph_module: GraphModule) -> bool:
        """Whether its last run observed the program on some input (not skipped)."""
        return observed(graph_module.meta.get(cls.STATUS_KEY, ""))

    def call(self, graph_module: GraphModule) -> PassResult:
        calls = calibration_calls(self.program, self.calibration)
        graph_module.meta.pop(self.OUTPUTS_KEY, None)
        if not calls:
            graph_module.meta[self.STATUS_KEY] = "skipped: no calibration inputs"
            return PassResult(graph_module, False)
        boundaries = Facts.of(graph_module).boundaries
        recorder = MagnitudeRecorder(
            graph_module,
            constant={slot.placeholder for slot in self.program.state_slots()},
            watched=_singular_arguments(boundaries) | _exponents_add(graph_module),
        )
        outputs, shapes = [], []
        with torch.no_grad():
            for index, (args, kwargs) in enumerate(calls):
                try:
                    inputs = self.program.graph_inputs(args, kwargs, copy_buffers=True, widen=False)
                    outputs.append(pytree.tree_leaves(recorder.run(*inputs)))
                except Exception as error:
                    return self.failed(graph_module, index, error)
                shapes.append([getattr(value, "shape", None) for value in inputs])
        graph_module.meta[self.OUTPUTS_KEY] = outputs
        _forget_observations(boundaries)
        for node, magnitude in recorder.magnitudes.items():
            node.meta[self.META_KEY] = magnitude
        _judge_at_size_bounds(graph_module, recorder, shapes)
        for node in _sentinels_fp16_cannot_carry(graph_module, recorder.sentinels):
            node.meta[self.META_KEY] = math.inf
        for node, extremes in recorder.int_ranges.items():
            node.meta[self.INT_RANGE_KEY] = extremes
        for node, interval in recorder.intervals.items():
            node.meta[self.INTERVAL_KEY] = interval
        for node in recorder.sentinels:
            node.meta[self.SENTINEL_KEY] = True
        for node, ratio in recorder.centering.items():
            node.meta[self.CENTERING_KEY] = ratio
        for node, smallest in recorder.smallest.items():
            node.meta[self.SMALLEST_KEY] = smallest
        _share_with_unreached_values(boundaries)
        graph_module.meta[self.STATUS_KEY] = f"{_OBSERVED} {len(calls)} input(s)"
        return PassResult(graph_module, False)

    def failed(self, graph_module: GraphModule, index: int, error: Exception) -> PassResult:
        """The program fails on calibration input ``index``: the user's inputs are an
        error, never a silent skip; its own example inputs are skipped, with a warning."""
        if self.calibration is not None:
            raise InvalidOptionError(
                f"calibration[{index}]: the program fails on it: {one_line(error)}"
            ) from error
        status = f"skipped: the program fails on its example inputs ({one_line(error)})"
        graph_module.meta[self.STATUS_KEY] = status
        warnings.warn(f"fx16 {status}", RuntimeWarning, stacklevel=3)
        return PassResult(graph_module, False)


def _judge_at_size_bounds(graph_module: GraphModule, recorder, shapes: list) -> None:
    """Scale what calibration saw of each value that grows with a dynamic size to the
    size's bound (``fx16.analysis.size_growth``), so every rule judges it there; the
    factor and the lengths go on the node, the lengths on the graph (the envelope)."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    growth = size_growth(graph_module.graph.nodes, calibrated_sizes(placeholders, shapes))
    for node, (factor, lengths) in growth.items():
        node.meta[meta.SIZE_GROWTH] = (factor, lengths, recorder.magnitudes.get(node))
        if node in recorder.magnitudes:
            recorder.magnitudes[node] *= factor
            node.meta[CalibrationAnalysis.META_KEY] = recorder.magnitudes[node]
        if node in recorder.intervals:
            low, high = recorder.intervals[node]
            recorder.intervals[node] = (min(low, low * factor), max(high, high * factor))
    lengths = sorted({part for _, said in growth.values() for part in said.split("; ")})
    graph_module.meta[meta.DYNAMIC_LENGTHS] = tuple(lengths)


_OBSERVATIONS = (
    CalibrationAnalysis.META_KEY,
    CalibrationAnalysis.INTERVAL_KEY,
    CalibrationAnalysis.SENTINEL_KEY,
    CalibrationAnalysis.SMALLEST_KEY,
)


def _share_with_unreached_values(boundaries: Boundaries) -> None:
    """A body's placeholder no run reached (cond's branch not taken) holds what its
    operands held: their observations, combined; then, in graph order, a cast no run
    reached that represents its source exactly (fp16 to fp32) holds what its source does."""
    for module in boundaries.graph_modules:
        for placeholder in module.graph.find_nodes(op="placeholder"):
            sources = boundaries.crossing_sources(placeholder)
            if CalibrationAnalysis.META_KEY in placeholder.meta or not sources:
                continue
            _share(placeholder, sources)
        for node in module.graph.nodes:
            if CalibrationAnalysis.META_KEY not in node.meta and _exact_cast(node):
                _share(node, [node.args[0]])


def _share(node: Node, sources: list[Node]) -> None:
    for key in _OBSERVATIONS:
        seen = [source.meta[key] for source in sources if key in source.meta]
        if seen:
            node.meta[key] = _combined(key, seen)


def _exact_cast(node: Node) -> bool:
    """A cast whose every result is its source's value (fp16 or bf16 to fp32)."""
    if not is_cast(node):
        return False
    source, target = source_dtype(node), cast_dtype(node)
    return source is not None and target is not None and represents_exactly(source, target)


def _combined(key: str, seen: list):
    if key == CalibrationAnalysis.INTERVAL_KEY:
        return min(low for low, _ in seen), max(high for _, high in seen)
    return min(seen) if key == CalibrationAnalysis.SMALLEST_KEY else max(seen)


def _singular_arguments(boundaries: Boundaries) -> set[Node]:
    """The values that ops singular at zero read where they are singular, and, for a
    body's placeholder, the operands it holds (a branch no run takes reads theirs)."""
    pending = []
    for module in boundaries.graph_modules:
        for node in module.graph.nodes:
            position = SINGULAR_AT_ZERO.get(node.target)
            if position is not None and position < len(node.args):
                if isinstance(node.args[position], Node):
                    pending.append(node.args[position])
    found = set()
    while pending:
        node = pending.pop()
        if node not in found:
            found.add(node)
            pending.extend(boundaries.crossing_sources(node))
    return found


def _exponents_add(graph_module: GraphModule) -> set[Node]:
    """The products and powers of the top-level graph: carried at a scale, their
    exponent is their operands' added (or multiplied), which may leave fp32's range."""
    return {
        node
        for node in graph_module.graph.nodes
        if node.op == "call_function" and rule_of(node).kind in (Kind.PRODUCT, Kind.POWER)
    }


def recalibrate(graph_module: GraphModule, program: Program, calibration: list | None) -> None:
    """Forget what calibration observed of ``graph_module`` (and the facts derived from
    it) and observe the rewritten program again on the same inputs."""
    Facts.invalidate(graph_module)
    CalibrationAnalysis(program, calibration)(graph_module)


def _forget_observations(boundaries: Boundaries) -> None:
    """Drop what an earlier run observed, in the bodies too (a program cast before, or
    calibrated on other inputs): this run's observations replace them whole, so a
    sentinel or a magnitude it did not see is not kept, and a body's placeholder no run
    reached takes its operands' observations."""
    for module in boundaries.graph_modules:
        for node in module.graph.nodes:
            for key in _OBSERVED_FACTS:
                node.meta.pop(key, None)


def share_observations(source: Node, target: Node) -> None:
    """Give ``target``, a node a pass made to compute the same values as ``source``,
    what calibration observed of ``source`` (no second run)."""
    for key in _OBSERVED_FACTS:
        if key in source.meta:
            target.meta[key] = source.meta[key]


# What calibration writes on a node: a run replaces them all, a rewrite shares them.
_OBSERVED_FACTS = (
    meta.OBSERVED_MAX_ABS,
    meta.OBSERVED_INTERVAL,
    meta.OBSERVED_SENTINEL,
    meta.OBSERVED_CENTERING,
    meta.OBSERVED_SMALLEST,
    meta.OBSERVED_INT_RANGE,
    meta.SIZE_GROWTH,
)


def _sentinels_fp16_cannot_carry(graph_module: GraphModule, sentinels: set[Node]) -> set[Node]:
    """The sentinel-holding nodes some use of which would see a wrong value after
    saturation (nodes outside ``tolerating_sentinels``)."""
    return sentinels - tolerating_sentinels(graph_module) if sentinels else set()


def tolerating_sentinels(graph_module: GraphModule) -> set[Node]:
    """The nodes whose every use sees the same result with a sentinel saturated.

    One walk in reverse order: a node is fine when each user absorbs the sentinel,
    or passes it on and is fine itself, or is the program output. Nodes that held
    no sentinel on the calibration inputs count too: a ``where`` that picked none
    of a mask's ``finfo.min`` on an all-ones mask still passes it on for others.
    """
    fine: set[Node] = set()
    for node in reversed(graph_module.graph.nodes):
        if all(
            user.op == "output"
            or _absorbs_sentinels(user.target)
            or (_passes_sentinels(user.target) and user in fine)
            for user in node.users
        ):
            fine.add(node)
    return fine


@per_op
def _absorbs_sentinels(target) -> bool:
    return target in SENTINEL_ABSORBING_OPS


@per_op
def _passes_sentinels(target) -> bool:
    return target in SENTINEL_PASSING_OPS
