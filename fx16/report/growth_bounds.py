"""Bounds on the values that mix degrees of growth, for the envelope's "larger inputs"
figure (``fx16.report.envelope``).

A value of degree d whose every term grows as the inputs ** d holds, at inputs f times
the calibration inputs, f**d times what calibration saw: its calibrated maximum bounds
it. A value that adds a term of lower degree does not: ``W x + b`` where the bias
cancelled ``W x`` in an element calibration saw small grows there as f W x, not as f
times the small sum, and a product with it (``x * linear(x)``) passes 65504 before the
figure its maximum gives. For such a value this module gives B with |value| <= B f**d
for every f >= 1, from its parts (a part's B: its calibrated maximum, or its own bound):

- a sum: the sum of its parts' B; a selection (``where``, ``maximum``, ``cat``, ``clamp``):
  their largest;
- a product: the product of its factors' B;
- a layer with a bias (``linear``, ``addmm``, a convolution) of an input that mixes
  nothing: its calibrated maximum plus twice the bias's largest magnitude (the product
  alone is at most the maximum plus the bias);
- an op that keeps magnitudes (a view, a cast, ``abs``, ``relu``, a mean): its operand's;
- a logarithm, which mixes always (``log(f v) = log v + log f``): at most
  ``max(|log smallest|, |log B| + 1)`` times f**d for its argument's B and smallest
  calibrated magnitude (``d log f <= f**d``), over ``log(base)``; ``log1p`` of an
  argument seen at or above 0, ``log1p(B) + 1``.

A body's operand and a higher-order op's result take the largest of what they stand for.
Any other op reading such a value has no bound here (None): the envelope then states no
figure rather than one that may be false.

Reads: the degrees (``fx16.report.degrees``), ``meta["fx16.observed_max_abs"]``
(CalibrationAnalysis), the program's state tensors (a bias's values).
"""

import math
import operator

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from fx16 import meta
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from fx16.program.nodes import is_number, node_val, tensor_leaves

# Ops whose result is the sum of their tensor operands (the second times ``alpha``).
_SUMS = frozenset({"add", "sub"})
# Ops each of whose elements is one of their operands' (or a constant's).
_SELECTIONS = frozenset({"where", "maximum", "minimum", "cat", "stack", "clamp", "clamp_min"})
# Ops whose result is bounded by their first operand's largest magnitude.
_KEEPING = frozenset(
    {
        *("abs", "neg", "relu", "gelu", "silu", "clone", "alias", "contiguous", "_to_copy"),
        *("view", "reshape", "_unsafe_view", "permute", "transpose", "t", "expand"),
        *("squeeze", "unsqueeze", "flatten", "slice", "select", "index_select", "flip"),
        *("mean", "amax", "amin", "max", "min", "dropout", "to", "type_as"),
    }
)
# Logarithms (``fx16.report.degrees.LOGARITHMS``), by their base's natural logarithm.
_LOGARITHMS = {"log": 1.0, "log2": math.log(2.0), "log10": math.log(10.0)}
# Layers whose product is followed by a bias: the bias's position among their arguments.
_BIASED = {"linear": 2, "conv1d": 2, "conv2d": 2, "conv3d": 2, "convolution": 2, "addmm": 0}


def growth_bounds(ep: ExportedProgram, degrees: dict) -> dict[Node, float | None]:
    """B for each value of degree > 0 that mixes degrees (see the module), None where no
    bound is known; a value that mixes nothing is not in the result."""
    magnitude = _Magnitudes(Program.of(ep))
    boundaries = Boundaries(ep.graph_module)
    bounds: dict[Node, float | None] = {}
    for _ in boundaries.graph_modules:  # again until a body's bounds reach its readers
        before = dict(bounds)
        for module in boundaries.graph_modules:
            for node in module.graph.nodes:
                degree = degrees.get(node)
                if node.op not in ("placeholder", "call_function") or not degree or degree <= 0:
                    continue
                if node.op == "placeholder" or node.target is operator.getitem:
                    found = _crossing(boundaries.inputs(node), bounds, magnitude)
                else:
                    found = _bound(node, degrees, bounds, magnitude)
                if found is not _MIXES_NOTHING:
                    bounds[node] = found
        if bounds == before:
            break
    return bounds


_MIXES_NOTHING = object()  # what ``_bound`` gives a value whose terms share one degree


def _crossing(sources: list[Node], bounds: dict, magnitude) -> float | None | object:
    """A body's operand, or a higher-order op's result: the largest of what it stands
    for, where any of that mixes degrees."""
    if not any(source in bounds for source in sources):
        return _MIXES_NOTHING
    found = [_of(source, bounds, magnitude) for source in sources]
    return None if None in found else max(found)


def _bound(node: Node, degrees: dict, bounds: dict, magnitude) -> float | None | object:
    name = getattr(node.target, "_opname", "")
    parts = [arg for arg in _operands(node, name) if _counts(arg)]
    tensors = [part for part in parts if isinstance(part, Node)]
    mixed = any(part in bounds for part in tensors)
    if name in _BIASED:
        return _biased(node, _BIASED[name], bounds, magnitude)
    if name == "log1p" and tensors:
        return _log1p(tensors[0], bounds, magnitude)
    if name in _LOGARITHMS and tensors:
        return _logarithm(tensors[0], _LOGARITHMS[name], bounds, magnitude)
    if name in _SUMS or name in _SELECTIONS:
        spread = {degrees.get(part, 0.0) if isinstance(part, Node) else 0.0 for part in parts}
        if not mixed and len(spread) == 1:
            return _MIXES_NOTHING
        found = [_of(part, bounds, magnitude) for part in parts]
        if None in found:
            return None
        if name in _SUMS:
            alpha = abs(node.kwargs.get("alpha", 1))
            return found[0] + alpha * sum(found[1:])
        return max(found)
    if not mixed:
        return _MIXES_NOTHING
    if name == "mul":
        found = [_of(part, bounds, magnitude) for part in parts]
        return None if None in found else math.prod(found)
    if name in _KEEPING and tensors and tensors[0] in bounds:
        return bounds[tensors[0]]
    return None


def _biased(node: Node, position: int, bounds: dict, magnitude) -> float | None | object:
    """A layer's bound: its maximum plus twice its bias's, where its input mixes nothing."""
    bias = node.args[position] if len(node.args) > position else node.kwargs.get("bias")
    operands = [a for i, a in enumerate(node.args) if i != position and isinstance(a, Node)]
    if any(operand in bounds for operand in operands):
        return None
    if bias is None:
        return _MIXES_NOTHING
    seen, largest_bias = meta.observed_max_abs(node), _of(bias, bounds, magnitude)
    if seen is None or largest_bias is None:
        return None
    return seen + 2 * largest_bias


def _logarithm(argument: Node, base: float, bounds: dict, magnitude) -> float | None:
    largest_seen = _of(argument, bounds, magnitude)
    smallest = argument.meta.get(meta.OBSERVED_SMALLEST)
    if not (largest_seen and smallest and smallest > 0):
        return None
    return max(abs(math.log(smallest)), abs(math.log(largest_seen)) + 1.0) / base


def _log1p(argument: Node, bounds: dict, magnitude) -> float | None:
    """``log1p(v)`` of a v calibration saw at or above 0: at most ``log1p(B) + 1`` times
    f**d (``log1p(B f**d) <= log1p(B) + d log f``); None where v went below 0 (towards -1
    its logarithm has no bound)."""
    largest_seen = _of(argument, bounds, magnitude)
    interval = meta.observed_interval(argument)
    if largest_seen is None or not interval or interval[0] < 0:
        return None
    return math.log1p(largest_seen) + 1.0


def _operands(node: Node, name: str) -> list:
    """The arguments that are values of the result: a concatenation's tensors, a clamp's
    limits, not a dim."""
    if name in ("cat", "stack"):
        return list(node.args[0])
    if name in ("clamp", "clamp_min"):
        return [*node.args, node.kwargs.get("min"), node.kwargs.get("max")]
    return list(node.args)


def _counts(arg) -> bool:
    """A float tensor operand or a nonzero number (a zero adds nothing)."""
    if isinstance(arg, Node):
        return any(leaf.is_floating_point() for leaf in tensor_leaves(node_val(arg)))
    return is_number(arg) and not isinstance(arg, bool) and arg != 0


def _of(part, bounds: dict, magnitude) -> float | None:
    if isinstance(part, Node):
        return bounds[part] if part in bounds else magnitude(part)
    return abs(float(part))


class _Magnitudes:
    """A value's largest magnitude: a state tensor's own, else what calibration saw."""

    def __init__(self, program: Program) -> None:
        self.tensors = {
            slot.placeholder: tensor
            for slot in program.state_slots()
            if (tensor := program.state_tensor(slot.target)) is not None
        }

    def __call__(self, node: Node) -> float | None:
        tensor = self.tensors.get(node)
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            return float(tensor.detach().abs().max()) if tensor.numel() else 0.0
        return meta.observed_max_abs(node)
