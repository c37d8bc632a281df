"""How each value of a program grows with its float inputs: the degree the envelope's
"larger inputs" figure divides by (``fx16.report.envelope``).

Reads: ``meta["val"]``, the program's user inputs and its bodies' boundaries,
``meta["fx16.observed_smallest"]`` (CalibrationAnalysis) on a negative power's argument.
"""

from torch.export import ExportedProgram
from torch.fx import Node

from fx16 import meta
from fx16.ops.kinds import (
    ATTENTION_OPS,
    EXPONENTIAL_GROWTH_OPS,
    GROWTH_MULTIPLYING_OPS,
    SCALE_BOUNDED_OPS,
)
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from fx16.program.casts import is_cast
from fx16.program.nodes import is_number, node_val, tensor_leaves

# Logarithms: they grow without bound, slower than any power (``d log f <= f**d``).
LOGARITHMS = frozenset({"log", "log2", "log10", "log1p"})
# A negative power of a floored value shrinks only where the floor is this far below the
# smallest value calibration saw it take.
FLOOR_HEADROOM = 2.0


def input_degrees(ep: ExportedProgram) -> dict[Node, float | None]:
    """How each value grows when the program's float user inputs grow: as their scale
    to this power (1 for a linear of an input, 2 for attention scores ``q kᵀ``, 0 for a
    weight, a norm's output, a softmax or what token ids select; None where it grows
    faster than any power, an exponential of them). Bodies read their operands', and
    what reads a body's results reads its outputs': the graphs are walked again until
    nothing changes (a body is walked after the graph holding its op, so its results
    reach that graph on the next walk; at most one walk more per graph)."""
    boundaries = Boundaries(ep.graph_module)
    program = Program.of(ep)
    program_inputs = {node.name for node in program.user_input_placeholders()}
    numbers = {  # the program's one-element float constants (a scalar fx16 made one), by node
        slot.placeholder: float(tensor)
        for slot in program.state_slots()
        if (tensor := program.state_tensor(slot.target)) is not None
        and tensor.numel() == 1
        and tensor.is_floating_point()
    }
    degrees: dict[Node, float | None] = {}
    for _ in boundaries.graph_modules:
        before = dict(degrees)
        for module in boundaries.graph_modules:
            for node in module.graph.nodes:
                degrees[node] = _degree(
                    node, degrees, boundaries, (program_inputs, numbers), module
                )
        if degrees == before:
            break
    return degrees


def _degree(node, degrees, boundaries, known, module) -> float | None:
    """``node``'s degree from its arguments'; ``known``: the program's user input names
    and its one-element constants' values."""
    program_inputs, numbers = known
    val = node_val(node)
    floats = [leaf for leaf in tensor_leaves(val) if leaf.is_floating_point()]
    if node.op == "placeholder":
        sources = boundaries.crossing_sources(node)
        if sources:
            found = [degrees.get(source, 0.0) for source in sources]
            return None if None in found else max(found)
        top = module is boundaries.graph_modules[0]
        return 1.0 if top and node.name in program_inputs and floats else 0.0
    if node.op != "call_function" or not floats:
        return 0.0
    inputs = [degrees.get(arg, 0.0) for arg in boundaries.inputs(node)]
    if None in inputs:
        return None
    name = getattr(node.target, "_opname", "")
    tensors = [arg for arg in node.args if isinstance(arg, Node)]
    own = [degrees.get(arg, 0.0) for arg in tensors]
    if name in LOGARITHMS:  # log(f v) = log v + d log f: bounded by its parts (growth_bounds)
        return own[0] if own else 0.0
    if name in SCALE_BOUNDED_OPS:
        return 0.0
    if name in EXPONENTIAL_GROWTH_OPS:
        return None if max(inputs, default=0.0) > 0 else 0.0
    if name in ATTENTION_OPS:  # a weighted mean of the values
        return own[2] if len(own) > 2 else max(inputs, default=0.0)
    if name == "pow" and len(node.args) > 1 and isinstance(node.args[1], (int, float)):
        return own[0] * node.args[1] if own else 0.0
    if name in ("div", "reciprocal", "rsqrt", "sqrt", "var", "std"):
        first = own[0] if own else 0.0
        shrinking = _growing(tensors[0], first, numbers) if tensors else 0.0
        return {
            "div": first - (_growing(tensors[1], own[1], numbers) if len(own) > 1 else 0.0),
            "reciprocal": -shrinking,
            "rsqrt": -shrinking / 2,
            "sqrt": first / 2,
            "var": 2 * first,
            "std": first,
        }[name]
    if name in ("addmm", "baddbmm", "addbmm", "addmv"):  # input + a product
        return max(own[0], own[1] + own[2]) if len(own) >= 3 else max(own, default=0.0)
    if name in GROWTH_MULTIPLYING_OPS:
        return sum(own)
    return max(inputs, default=0.0)


def _growing(argument: Node, degree: float, numbers: dict) -> float:
    """The degree a negative power of ``argument`` shrinks by: ``degree``, or 0 where a
    constant floors it (``|x| + k``, ``clamp(x, min=k)``) and calibration saw it within
    ``FLOOR_HEADROOM`` of that floor: those elements do not grow with the inputs (until
    they pass the floor by far), so their power does not shrink, and a product with them
    grows as its other factor alone."""
    while isinstance(argument, Node) and is_cast(argument):  # fx16's cast to 16-bit
        argument = argument.args[0]
    floor = _floor(argument, numbers)
    if floor is None or degree <= 0:
        return degree
    smallest = argument.meta.get(meta.OBSERVED_SMALLEST)
    return degree if smallest and smallest > FLOOR_HEADROOM * floor else 0.0


def _floor(node: Node, numbers: dict) -> float | None:
    """The constant k > 0 of ``x + k`` (``x - (-k)``; k a number or a one-element constant
    in ``numbers``) or ``clamp(x, min=k)``, else None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    name = getattr(node.target, "_opname", "")
    if name in ("add", "sub"):
        sign = 1 if name == "add" else -1
        constant = node.args[1] if len(node.args) > 1 else None
        constant = numbers.get(constant, constant) if isinstance(constant, Node) else constant
        return sign * constant if is_number(constant) and sign * constant > 0 else None
    if name in ("clamp", "clamp_min"):
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        return low if is_number(low) and low > 0 else None
    return None
