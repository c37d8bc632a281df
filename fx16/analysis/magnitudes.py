"""What calibration records of each value as the program runs: the largest magnitude,
the interval, masking sentinels, integer extremes, the smallest nonzero magnitude of
values a singular op reads, and the cancellation inside centering ops."""

import math

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from fx16.analysis.centering import CENTERING_OPS, cancellation_ratio, centered_input
from fx16.ops.int_ops import INT_DTYPES
from fx16.ops.numerics import INF_LIKE
from fx16.ops.tables import overloads, per_op
from fx16.program.interpreter import BodyInterpreter
from fx16.program.tensor_subclasses import inner_tensors, is_subclass


def observe_floats(value) -> tuple[float | None, bool, tuple[float, float] | None]:
    """(largest finite non-sentinel magnitude, whether a finite magnitude >= 1e38
    occurs, (min, max) of the finite non-sentinel values) over the float tensors in
    ``value``; one reduction per ordinary tensor.
    A tensor subclass (a torchao quantized weight) is observed through its plain inner
    tensors: its own ops may not include a reduction."""
    if type(value) in _PLAIN_TENSORS:  # the common case: no subclass, nothing to flatten
        return _observe_tensor(value) if value.is_floating_point() else (None, False, None)
    largest, sentinel, interval = None, False, None
    if isinstance(value, torch.Tensor) and not is_subclass(value):
        leaves = [value]
    else:
        leaves = [
            inner
            for leaf in pytree.tree_leaves(value)
            if isinstance(leaf, torch.Tensor)
            for inner in inner_tensors(leaf).values()
        ]
    for leaf in leaves:
        if leaf.is_floating_point():
            top, seen, extremes = _observe_tensor(leaf)
            if top is not None:
                largest = top if largest is None else max(largest, top)
            sentinel = sentinel or seen
            if extremes is not None:
                interval = extremes if interval is None else _hull(interval, extremes)
    return largest, sentinel, interval


# Types that are never wrapper subclasses: observed without asking.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _observe_tensor(tensor: torch.Tensor) -> tuple[float | None, bool, tuple | None]:
    """``observe_floats`` of one plain float tensor: one ``aminmax``, and a closer look
    only when a sentinel, inf or nan is inside."""
    if not tensor.numel():
        return None, False, None
    low, high = tensor.aminmax()  # no detach: nothing here is differentiated
    low, high = low.item(), high.item()
    top = max(-low, high)
    if top < INF_LIKE:
        return top, False, (low, high)
    # a finite extreme this large is a sentinel; an inf or nan may hide one
    return _observe_past_sentinels(tensor.detach().float(), sentinel=math.isfinite(top))


def _observe_past_sentinels(values: torch.Tensor, sentinel: bool) -> tuple:
    """``_observe_tensor`` of values holding a sentinel, inf or nan: what the others hold."""
    magnitude = values.abs()
    if not sentinel:
        sentinel = bool(((magnitude >= INF_LIKE) & (magnitude != math.inf)).any())
    ordinary = magnitude < INF_LIKE  # also drops inf and nan
    low = torch.where(ordinary, values, math.inf).amin().item()
    if low == math.inf:
        return None, sentinel, (0, 0)
    high = torch.where(ordinary, values, -math.inf).amax().item()
    return max(-low, high), sentinel, (low, high)


def _hull(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return min(a[0], b[0]), max(a[1], b[1])


def integer_extremes(value) -> tuple[int, int] | None:
    """(min, max) of a single integer tensor, or None."""
    is_integer = isinstance(value, torch.Tensor) and value.dtype in INT_DTYPES
    if not is_integer or not value.numel():
        return None
    low, high = value.aminmax()  # one pass
    return int(low), int(high)


class MagnitudeRecorder(BodyInterpreter):
    """Runs a graph and records magnitudes, integer extremes and sentinels per node,
    in the bodies of higher-order ops too (over every iteration of a loop)."""

    def __init__(
        self,
        graph_module: GraphModule,
        parent: "MagnitudeRecorder | None" = None,
        constant: set[Node] = frozenset(),
        watched: set[Node] = frozenset(),
    ):
        """``constant``: the state placeholders, observed on the first input only (a
        weight holds the same values on every input); ``watched``: the values whose
        smallest nonzero magnitude to record."""
        super().__init__(graph_module)
        self.magnitudes: dict[Node, float] = parent.magnitudes if parent else {}
        self.int_ranges: dict[Node, tuple[int, int]] = parent.int_ranges if parent else {}
        self.sentinels: set[Node] = parent.sentinels if parent else set()
        self.intervals: dict[Node, tuple[float, float]] = parent.intervals if parent else {}
        self.centering: dict[Node, float] = parent.centering if parent else {}
        self.smallest: dict[Node, float] = parent.smallest if parent else {}
        self.constant = constant if parent is None else parent.constant
        self.watched = watched if parent is None else parent.watched
        self.observed: set[Node] = set()

    def inside(self, body: GraphModule) -> "MagnitudeRecorder":
        return MagnitudeRecorder(body, parent=self)

    def run_node(self, node: Node):
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        result = getattr(self, node.op)(node.target, args, kwargs)
        if _centers(node.target):
            self._observe_centering(node, args)
        interval = self._observe(node, result)
        if node in self.watched:
            self._observe_smallest(node, result, interval)
        return result

    def _observe(self, node: Node, result) -> tuple[float, float] | None:
        """Record ``node``'s magnitude, interval, sentinel and integer extremes for this
        run; the interval of its finite non-sentinel values this run gave (None where
        it was not reduced: a constant seen before, a view of an observed value)."""
        if node in self.constant:
            if node in self.observed:
                return None
            self.observed.add(node)
        if node.op == "call_function" and self._same_values_as_input(node, result):
            return None
        if node.op not in ("placeholder", "call_function"):
            return None
        magnitude, sentinel, interval = observe_floats(result)
        if magnitude is not None and not math.isnan(magnitude):
            self.magnitudes[node] = max(magnitude, self.magnitudes.get(node, 0.0))
        if interval is not None and not (math.isnan(interval[0]) or math.isnan(interval[1])):
            seen = self.intervals.get(node)
            self.intervals[node] = interval if seen is None else _hull(seen, interval)
        else:
            interval = None
        if sentinel:
            self.sentinels.add(node)
        extremes = integer_extremes(result)
        if extremes is not None:
            low, high = self.int_ranges.get(node, extremes)
            self.int_ranges[node] = (min(low, extremes[0]), max(high, extremes[1]))
        return interval

    def _same_values_as_input(self, node: Node, result) -> bool:
        """Record for a view, permute, expand, a dropout not training (an op whose
        result holds exactly its input's values) what its input recorded, without
        reducing it again: every call's values are the same, so is what they accumulate.
        False where it must be observed."""
        if not _holds_input_values(node) or not isinstance(result, torch.Tensor):
            return False
        source = node.args[0] if node.args else None
        if not isinstance(source, Node) or source.op not in ("placeholder", "call_function"):
            return False
        if not result.numel():
            return False
        for found in (self.magnitudes, self.intervals, self.int_ranges):
            if source in found:
                found[node] = found[source]
        if source in self.sentinels:
            self.sentinels.add(node)
        return True

    def _observe_centering(self, node: Node, args) -> None:
        centered = centered_input(node.target, args)
        if centered is not None:
            ratio = cancellation_ratio(centered)
            self.centering[node] = max(ratio, self.centering.get(node, 0.0))

    def _observe_smallest(self, node: Node, result, interval) -> None:
        """The smallest nonzero magnitude of a float tensor: of one sign, the end of
        ``interval`` nearer zero (what this run's reduction found: infinities and
        sentinels are larger than any value it holds), else reduced again."""
        if isinstance(result, torch.Tensor) and result.is_floating_point() and result.numel():
            plain = type(result) in _PLAIN_TENSORS
            nonzero = smallest_nonzero_magnitude(result, interval if plain else None)
            if math.isfinite(nonzero):
                self.smallest[node] = min(nonzero, self.smallest.get(node, math.inf))


def smallest_nonzero_magnitude(
    tensor: torch.Tensor, interval: tuple[float, float] | None = None
) -> float:
    """The smallest nonzero magnitude among a float tensor's non-nan elements (inf: none).
    Where the elements are all of one sign, the end of their interval nearer zero:
    ``interval`` where a reduction of this run found it (``observe_floats``': its finite
    non-sentinel values, and infinities and sentinels are larger than any), else one
    ``aminmax`` (a singular op's input mostly is: a variance, a probability). Otherwise
    the least of the magnitudes, looked at again past zeros only where one is zero."""
    if interval is None:
        interval = tuple(bound.item() for bound in tensor.detach().aminmax())
    low, high = interval
    if 0 < low < math.inf:
        return low
    if -math.inf < high < 0:
        return -high
    magnitude = tensor.detach().abs()
    least = magnitude.amin().item()
    if least > 0:  # no zero among them (a nan fails the comparison)
        return least
    return torch.where(magnitude > 0, magnitude, torch.inf).amin().item()


@per_op
def _centers(target) -> bool:
    return target in CENTERING_OPS


def _holds_input_values(node: Node) -> bool:
    """Whether ``node``'s result holds every value of its first argument and no other
    (for a nonempty result)."""
    return _keeps_values(node.target) or _inference_dropout(node)


@per_op
def _keeps_values(target) -> bool:
    """Ops whose result holds every value of their first argument and no other (for a
    nonempty result): views, permutes, expands, clones."""
    return target in _SAME_VALUES_OPS


def _inference_dropout(node: Node) -> bool:
    """A dropout not training (``train=False``): its result holds its input's values."""
    if not _drops_out(node.target):
        return False
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return train is False


@per_op
def _drops_out(target) -> bool:
    return target in _DROPOUTS


_DROPOUTS = overloads(
    "dropout.default",
    "feature_dropout.default",
    "alpha_dropout.default",
    "feature_alpha_dropout.default",
)

_SAME_VALUES_OPS = overloads(
    "view.default",
    "_unsafe_view.default",
    "reshape.default",
    "permute.default",
    "transpose.int",
    "t.default",
    "unsqueeze.default",
    "squeeze.default",
    "squeeze.dim",
    "squeeze.dims",
    "expand.default",
    "alias.default",
    "clone.default",
    "detach.default",
    "flatten.using_ints",
    "lift_fresh_copy.default",
)
