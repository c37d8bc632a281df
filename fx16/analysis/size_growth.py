"""How much larger a value may be at the bounds of the program's dynamic sizes than
calibration saw it.

A sum over a dynamic dimension grows with its length: a bag of embeddings calibrated at
16 tokens holds 256x more at 4096, past fp16's range where calibration saw ~410.
Calibration runs at the sizes of its inputs; a decision that a value fits must hold at
every size the program accepts. ``size_growth`` gives, per value, the factor by which
its magnitude may exceed calibration's at the largest size of each dynamic dimension
(``torch.export``'s ``Dim(max=...)``; ``UNBOUNDED_LENGTH`` where nothing bounds it),
walking the graph in order:

- a sum over a dynamic dimension (``sum``, ``nansum``, ``cumsum``) multiplies its
  input's factor by the dimension's largest size over its calibrated size; so does a
  product contracting one (``mm``, ``bmm``, ``matmul``), except where the operand
  contracted is a softmax over it (its weights sum to one);
- a product multiplies its operands' factors, a power raises its operand's to the
  power; an exponential of a growing value grows past any factor (``inf``);
- softmax, norms, recurrent layers, means, reciprocals and comparisons are bounded
  whatever the sizes (1); attention is its values' factor;
- every other op takes the largest factor among its inputs.

Bodies of higher-order ops are not walked (their values keep calibration's).
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import sympy
import torch
from torch.fx import Node

from fx16.ops.kinds import ATTENTION_OPS, EXPONENTIAL_GROWTH_OPS, SCALE_BOUNDED_OPS, op_name
from fx16.ops.numeric_tables import SOFTMAX_OPS
from fx16.program.nodes import node_val, tensor_leaves

# The length a dynamic dimension is judged at where nothing bounds it.
UNBOUNDED_LENGTH = 8192

_SUMS = frozenset({"sum", "nansum", "cumsum"})
_CONTRACTIONS = frozenset({"mm", "bmm", "matmul"})
_PRODUCTS = frozenset({"mul", "linear", "addmm", "baddbmm", "einsum"}) | _CONTRACTIONS
_BOUNDED = frozenset(
    {"mean", "reciprocal", "rsqrt", "sigmoid", "tanh", "sign", "cos", "sin", "erf"}
    | {"eq", "ne", "lt", "le", "gt", "ge", "argmax", "argmin", "isnan", "isinf"}
)
_PASS_THROUGH = frozenset({"view", "reshape", "_to_copy", "to", "clone", "contiguous", "expand"})


@dataclass
class CalibratedSizes:
    """The largest value each dynamic size's symbol took on calibration's inputs, and
    where it shows (an input's dimension: "ids.shape[1]")."""

    values: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)


def calibrated_sizes(placeholders: list[Node], calls: Iterable[list]) -> CalibratedSizes:
    """The sizes of the placeholders' dynamic dimensions over the calibration ``calls``
    (each the shapes of the graph's positional inputs, None for a value without one)."""
    seen = CalibratedSizes()
    for shapes in calls:
        for placeholder, shape in zip(placeholders, shapes):
            val = node_val(placeholder)
            if not isinstance(val, torch.Tensor) or shape is None:
                continue
            for dim, (size, concrete) in enumerate(zip(val.shape, shape)):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    symbol = size.node.expr
                    seen.values[symbol] = max(seen.values.get(symbol, 0), int(concrete))
                    seen.labels.setdefault(symbol, f"{placeholder.name}.shape[{dim}]")
    return seen


def size_growth(nodes: Iterable[Node], seen: CalibratedSizes) -> dict[Node, tuple[float, str]]:
    """Each value of ``nodes`` (one graph's, in order) that may be larger at the
    dynamic sizes' bounds than on calibration's inputs (``seen``: ``calibrated_sizes``):
    the factor, and the lengths it rests on ("ids.shape[1] at 4096 (its bound,
    calibrated at 16)"; several joined by "; ")."""
    growth: dict[Node, tuple[float, str]] = {}
    if not seen.values:
        return growth
    for node in nodes:
        if node.op != "call_function":
            continue
        found = _growth(node, growth, seen)
        if found[0] > 1:
            growth[node] = found
    return growth


def _growth(node: Node, growth: dict, seen: CalibratedSizes) -> tuple[float, str]:
    val = node_val(node)
    if not any(leaf.is_floating_point() for leaf in tensor_leaves(val)):
        return 1.0, ""
    name = op_name(node) or ""
    tensors = [arg for arg in node.args if isinstance(arg, Node)]
    own = [growth.get(arg, (1.0, "")) for arg in tensors]
    inputs = [growth.get(arg, (1.0, "")) for arg in node.all_input_nodes]
    if name in SCALE_BOUNDED_OPS or name in _BOUNDED or node.target in SOFTMAX_OPS:
        return 1.0, ""
    if name in ATTENTION_OPS:
        return own[2] if len(own) > 2 else _largest(inputs)
    if name in EXPONENTIAL_GROWTH_OPS:
        largest = _largest(inputs)
        return (math.inf, largest[1]) if largest[0] > 1 else (1.0, "")
    if name == "pow" and len(node.args) > 1 and isinstance(node.args[1], (int, float)):
        factor, why = own[0] if own else (1.0, "")
        return (factor ** node.args[1], why) if node.args[1] > 0 else (1.0, "")
    if name in ("div", "sqrt"):  # a quotient grows with its numerator alone
        factor, why = growth.get(node.args[0], (1.0, "")) if tensors else (1.0, "")
        return (math.sqrt(factor) if name == "sqrt" else factor), why
    if name in _SUMS:
        return _combine([_largest(inputs), _summed(node, seen)])
    if name in _PRODUCTS:
        contracted = _contracted(node, seen) if name in _CONTRACTIONS else (1.0, "")
        return _combine([*own, contracted])
    return _largest(inputs)


def _summed(node: Node, seen: CalibratedSizes) -> tuple[float, str]:
    """The growth of ``node``'s reduced dimensions (all, where none are named)."""
    source = node_val(node.args[0])
    if not isinstance(source, torch.Tensor):
        return 1.0, ""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        dims = range(source.dim())
    elif isinstance(dims, int):
        dims = [dims]
    return _combine([_length_growth(source.shape[d], seen) for d in dims])


def _contracted(node: Node, seen: CalibratedSizes) -> tuple[float, str]:
    """The growth of the dimension a matmul contracts: 1 where its left operand is a
    softmax over it (weights that sum to one)."""
    left = node.args[0]
    if _is_softmax(left):
        return 1.0, ""
    val = node_val(left)
    return _length_growth(val.shape[-1], seen) if isinstance(val, torch.Tensor) else (1.0, "")


def _is_softmax(node) -> bool:
    while isinstance(node, Node) and op_name(node) in _PASS_THROUGH:
        node = node.args[0]
    return isinstance(node, Node) and node.target in SOFTMAX_OPS


def _length_growth(size, seen: CalibratedSizes) -> tuple[float, str]:
    """largest(size) / its calibrated value, for a dynamic size; 1 for a static one."""
    if not isinstance(size, torch.SymInt):
        return 1.0, ""
    expr = size.node.expr
    calibrated = expr.subs(seen.values)
    if not calibrated.is_number or int(calibrated) <= 0:
        return 1.0, ""
    upper = float(size.node.shape_env.bound_sympy(expr).upper)
    if math.isfinite(upper):
        bound, said = int(upper), "its bound"
    else:
        bound, said = UNBOUNDED_LENGTH, "unbounded: fx16's default"
    if bound <= int(calibrated):
        return 1.0, ""
    where = seen.labels.get(expr, str(expr))
    return bound / int(calibrated), f"{where} at {bound} ({said}, calibrated at {int(calibrated)})"


def _largest(found: list[tuple[float, str]]) -> tuple[float, str]:
    return max(found, key=lambda item: item[0], default=(1.0, ""))


def _combine(found: list[tuple[float, str]]) -> tuple[float, str]:
    """Factors that multiply, with the lengths they rest on."""
    factor = math.prod(item[0] for item in found)
    said = sorted({item[1] for item in found if item[1]})
    return factor, "; ".join(said)
