"""ConditioningAnalysis: ops whose output 16-bit rounding of their input would spoil.

Rounding an input x to a 16-bit float moves it by up to u|x| (u = 2**-11 for fp16,
2**-8 for bf16). An op f turns that into a relative output error of about
kappa * u, with kappa = |x f'(x)| / |f(x)| its condition number. Taken normwise over
the range x takes (error against the largest output, as fx16's budget measures it):

- sin, cos, tan: kappa ~ max |x|. A rotary angle at position 1500 (fp16 spacing
  1 rad) or a timestep embedding at t = 999 comes out as noise.
- exp, exp2, expm1 over [lo, hi]: max |x| e^x / e^hi (large positive arguments).
- pow(b, x): max |x ln b|; pow(x, p): |p|.
- log over [lo, hi], lo > 0: 1 / max |ln x| (arguments near 1).
- a - b and a + b of tensors, or of a tensor and a Python number (``x - 1000.0``, whose
  magnitude is its own): (max|a| + max|b|) / max|a -/+ b| (cancellation), when
  it is 8 or more (three bits lost; a residual add's maxima give ratios near 2), and
  neither holds an infinity-like sentinel (an additive mask's ``finfo.min``).
- the ops that subtract a mean inside (batch, layer, group and instance norms, var,
  std: ``fx16.analysis.centering``): their input's cancellation ratio, max |x| / max
  |x - mean| per group, as calibration measured it (or, for a batch norm in
  inference that no input reached, |running_mean| / sqrt(running_var)), when it is 8
  or more.

Ranges: proven ones first (``fx16.analysis.float_range``: from integers, sizes,
constants, state), else what calibration observed. A periodic op whose argument
has no proven range is ill-conditioned: positions and timesteps grow past any
example, and sin/cos are a negligible share of a model's compute. Infinity-like
sentinels (|x| >= 1e38, the -1e38 a running maximum starts from) are left out of
every interval: e^(-1e38) is 0 in any precision.

An op is ill-conditioned when kappa * u exceeds the policy's
``precision_tolerance``. Keeping it in fp32 helps only if its input arrives with
fp32 accuracy, so its elementwise past is marked too (``fx16.analysis.upstream``:
reductions included, across higher-order ops' boundaries, up to the placeholders
it starts from, which the converters then keep fp32), stopping before a matrix
product, convolution or attention, which is read as computed.

Reads: ``meta["val"]``, ``meta["fx16.value_range"]`` (run ValueRangeAnalysis
first), ``meta["fx16.observed_interval"]``, ``meta["fx16.observed_range"]`` and
``meta["fx16.observed_centering"]`` (CalibrationAnalysis), the program's state.
Writes: ``node.meta["fx16.ill_conditioned"]``: why (a string), on every node to
keep fp32 for that reason, bodies included; absent elsewhere. And on each
ill-conditioned op, ``node.meta["fx16.conditioning"]``: a ``Finding`` (its condition
number and the chain marked for it), for VerdictCheckAnalysis.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.centering import CENTERING_OPS, buffer_ratio, running_statistics
from fx16.analysis.facts import Facts
from fx16.analysis.float_range import FloatRanges
from fx16.analysis.upstream import elementwise_past
from fx16.contracts import Analysis
from fx16.ops.numeric_tables import (
    EXPONENTIAL_OPS,
    LOGARITHM_OPS,
    PERIODIC_OPS,
    POWER_BY_SCALAR_OPS,
    POWER_OF_SCALAR_OPS,
    SUM_OPS,
)
from fx16.ops.numerics import INF_LIKE
from fx16.policy import PrecisionPolicy
from fx16.program import Program
from fx16.program.nodes import node_val

aten = torch.ops.aten

# A sum cancels once it loses three bits: below that, maxima of different elements
# (a residual add, two embeddings) give ratios near 2 with nothing cancelling.
_CANCELLING = 8.0

Interval = tuple[float, float]


@dataclass(frozen=True)
class Finding:
    """An ill-conditioned op (``seed``), its condition number, and its elementwise past
    (the nodes of this walk: read them in the same pipeline run)."""

    seed: Node
    kappa: float
    chain: tuple[Node, ...]


class ConditioningAnalysis(Analysis):
    """Mark the ops whose condition number amplifies 16-bit input rounding past the
    policy's ``precision_tolerance``, with the values they read (see the module)."""

    META_KEY = meta.ILL_CONDITIONED
    FINDING_KEY = meta.CONDITIONING

    def __init__(self, program: Program, policy: PrecisionPolicy | None = None) -> None:
        self.program = Program.of(program)
        self.policy = policy or PrecisionPolicy.default()

    def call(self, graph_module: GraphModule) -> PassResult:
        boundaries = Facts.of(graph_module).boundaries
        ranges = Facts.of(graph_module).float_ranges(self.program)
        roundoff = torch.finfo(self.policy.low).eps / 2
        tolerance = self.policy.resolved_precision_tolerance
        seeds: list[tuple[Node, float]] = []
        intervals = _Ranges(ranges)
        for submodule in boundaries.graph_modules:
            for node in submodule.graph.nodes:
                node.meta.pop(self.META_KEY, None)
                node.meta.pop(self.FINDING_KEY, None)
                if node.op != "call_function" or meta.rounding_cancels(node):
                    continue
                found = _condition(node, intervals)
                if found is not None and found[0] * roundoff > tolerance:
                    kappa, why = found
                    node.meta[self.META_KEY] = (
                        f"{why}: condition number {kappa:.3g}, so 16-bit rounding of its input "
                        f"moves it by {kappa * roundoff:.2g} (tolerance {tolerance:.2g})"
                    )
                    seeds.append((node, kappa))
        for seed, kappa in seeds:
            chain = elementwise_past(seed, boundaries, ranges.of)
            for node in chain:
                node.meta.setdefault(self.META_KEY, f"feeds {seed.name}, kept in fp32")
            seed.meta[self.FINDING_KEY] = Finding(seed, kappa, tuple(chain))
        return PassResult(graph_module, False)


class _Ranges:
    """The interval a rule reads for a value: proven, else observed."""

    def __init__(self, proven: FloatRanges) -> None:
        self.proven = proven

    def interval(self, arg) -> Interval | None:
        """Sentinels left out: a value that holds nothing else has no interval."""
        found = self.proven.of(arg)
        if found is not None:
            if found.high <= -INF_LIKE or found.low >= INF_LIKE:
                return None
            return found.low, found.high
        if isinstance(arg, Node):
            return meta.observed_interval(arg)
        return None

    def magnitude(self, arg) -> float | None:
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return abs(float(arg))
        found = self.interval(arg)
        if found is not None:
            return max(abs(found[0]), abs(found[1]))
        return meta.observed_max_abs(arg)


# Every op a rule below reads, to skip the others with one look-up.
_CONDITIONED = frozenset().union(
    PERIODIC_OPS,
    EXPONENTIAL_OPS,
    LOGARITHM_OPS,
    POWER_OF_SCALAR_OPS,
    POWER_BY_SCALAR_OPS,
    SUM_OPS,
    CENTERING_OPS,
)


def _condition(node: Node, ranges: _Ranges) -> tuple[float, str] | None:
    """(condition number, what it is about) for the ops listed in the module, or None."""
    target, args = node.target, node.args
    if target not in _CONDITIONED:
        return None
    name = getattr(target, "_opname", "")
    val = node_val(node)
    if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
        return None
    if target in PERIODIC_OPS:
        proven = ranges.proven.of(args[0])
        if proven is None:
            return math.inf, f"{name} of a value with no proven range"
        largest = max(abs(proven.low), abs(proven.high))
        return max(largest, 1.0), f"{name} of values up to {largest:.4g}"
    if target in EXPONENTIAL_OPS:
        return _with_interval(ranges.interval(args[0]), name, _exponential(EXPONENTIAL_OPS[target]))
    if target in LOGARITHM_OPS:
        return _with_interval(ranges.interval(args[0]), name, _logarithm)
    if target in POWER_OF_SCALAR_OPS and isinstance(args[0], (int, float)) and args[0] > 0:
        scale = abs(math.log(args[0]))
        return _with_interval(
            ranges.interval(args[1]),
            f"{args[0]:g} ** x",
            lambda low, high: max(abs(low), abs(high)) * scale,
        )
    if target in POWER_BY_SCALAR_OPS and isinstance(args[1], (int, float)):
        return abs(args[1]), f"x ** {args[1]:g}"
    if target in SUM_OPS and any(isinstance(arg, Node) for arg in args[:2]):
        return _cancellation(node, ranges)
    if target in CENTERING_OPS:
        return _centering(node, ranges.proven)
    return None


def _with_interval(interval: Interval | None, name: str, kappa: Callable) -> tuple | None:
    if interval is None or not all(math.isfinite(bound) for bound in interval):
        return None
    return kappa(*interval), f"{name} of values in [{interval[0]:.4g}, {interval[1]:.4g}]"


def _exponential(scale: float) -> Callable[[float, float], float]:
    """max |x f'(x)| / max |f(x)| for f = e^(scale x) on [low, high]."""

    def kappa(low: float, high: float) -> float:
        candidates = [low, high] + ([-1.0 / scale] if low < -1.0 / scale < high else [])
        # |scale x| e^(scale (x - high)), in logs so that large arguments do not overflow
        return max(
            math.exp(math.log(abs(scale * x)) + scale * (x - high)) if x else 0.0
            for x in candidates
        )

    return kappa


def _logarithm(low: float, high: float) -> float:
    if low <= 0:
        return 0.0  # outside log's domain: not a rounding question
    largest = max(abs(math.log(low)), abs(math.log(high)))
    return math.inf if largest == 0 else 1.0 / largest


def _cancellation(node: Node, ranges: _Ranges) -> tuple[float, str] | None:
    """The larger of the whole tensor's cancellation and, for a subtraction of a
    per-slice statistic, the worst slice's (as calibration measured it)."""
    a, b, result = (ranges.magnitude(arg) for arg in (node.args[0], node.args[1], node))
    # a Python number cancels as a tensor of its value does (``x - 1000.0``)
    if a is None or b is None or max(a, b) >= INF_LIKE:  # an additive mask's finfo.min:
        return None  # a sentinel, not a rounding
    whole = (a + b) / result if result else 0.0
    sliced = node.meta.get(CalibrationAnalysis.CENTERING_KEY, 0.0)
    if max(whole, sliced) < _CANCELLING:
        return None
    if sliced > whole:
        return sliced, (
            f"a - b per slice: a slice of a reaches {sliced:.3g}x its largest deviation from "
            f"b there (observed; over the whole tensor {whole:.3g}x)"
        )
    operation = "a + b" if node.target._opname == "add" else "a - b"
    return whole, f"{operation} with |a| ~ {a:.3g}, |b| ~ {b:.3g}, result {result:.3g}"


def _centering(node: Node, ranges: FloatRanges) -> tuple[float, str] | None:
    """The cancellation ratio of an op that subtracts a mean inside it: as calibration
    measured it, else from a batch norm's running statistics."""
    ratio = node.meta.get(CalibrationAnalysis.CENTERING_KEY)
    seen = "observed"
    if ratio is None:
        statistics = running_statistics(node.target, node.args)
        tensors = [ranges.state_tensor(arg) for arg in statistics or ()]
        if len(tensors) != 2 or any(tensor is None for tensor in tensors):
            return None
        ratio, seen = buffer_ratio(*tensors), "from its running statistics"
    if ratio < _CANCELLING:
        return None
    return ratio, (
        f"cancellation inside {node.target._opname}: its input reaches {ratio:.3g}x its "
        f"largest deviation from the mean ({seen})"
    )
