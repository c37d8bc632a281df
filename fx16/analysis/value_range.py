"""ValueRangeAnalysis: an interval for every integer value, and where it comes from."""

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.facts import Facts
from fx16.analysis.index_bounds import index_bounds
from fx16.analysis.intervals import Source, ValueRange, union, value_range
from fx16.analysis.range_rules import RangeRules
from fx16.contracts import Analysis
from fx16.errors import InvalidOptionError
from fx16.ops.int_ops import INT_DTYPES
from fx16.program import Program
from fx16.program.nodes import dtype_name, node_val
from fx16.program.subgraphs import bodies_and_operands


def _checked_ranges(input_ranges) -> dict[str, tuple[int, int]]:
    """``input_ranges`` as given, once each entry is shown to be (low, high) integers."""
    if not isinstance(input_ranges, dict):
        raise InvalidOptionError(
            f"input_ranges must be a dict of name -> (low, high), got {type(input_ranges).__name__}"
        )
    for name, bounds in input_ranges.items():
        if not (
            isinstance(bounds, (tuple, list))
            and len(bounds) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
            and bounds[0] <= bounds[1]
        ):
            raise InvalidOptionError(
                f"input_ranges[{name!r}] must be (low, high) integers with low <= high, "
                f"got {bounds!r}"
            )
    return dict(input_ranges)


class ValueRangeAnalysis(Analysis):
    """Give every integer (and bool) value an interval, with its source.

    Facts come from integer constants and buffers, sizes bounded by the program's
    ``range_constraints``, ``arange``, ops with bounded results (remainder by a
    constant, clamp, comparisons, argmax/argmin/topk/sort indices, bucketize),
    interval arithmetic through add/sub/mul/neg/abs/cumsum/sum, data movement, and
    the user's ``input_ranges={"input_ids": (0, 999)}`` (source: declared). A value
    used as an index into a dimension of size N, or copied or shifted into one, lies
    in [-N, N-1] in every valid call (``fx16.analysis.index_bounds``): proven, where
    nothing tighter is known (a cache position writing a static cache). Where
    none of these gives a range and CalibrationAnalysis saw the value, its observed
    (min, max) is used, marked observed. Bodies of higher-order ops are ranged too
    (``fx16.program.boundaries``): a body's placeholder has its operands' range, an op's result
    its bodies' outputs'; a value a loop carries has only what calibration saw.

    Reads: the program's signature, state and range constraints, and
    ``meta["fx16.observed_int_range"]`` when calibration ran.
    Writes: ``node.meta["fx16.value_range"]``: a ValueRange, or a tuple of them for
    ops with several outputs; absent where nothing is known.
    """

    META_KEY = meta.PROVEN_RANGE

    def __init__(self, program: Program, input_ranges: dict | None = None) -> None:
        self.program = Program.of(program)
        self.input_ranges = _checked_ranges(input_ranges or {})

    def call(self, graph_module: GraphModule) -> PassResult:
        user_inputs = {node.name: node for node in self.program.user_input_placeholders()}
        unknown = sorted(set(self.input_ranges) - set(user_inputs))
        if unknown:
            raise InvalidOptionError(
                f"input_ranges names {unknown}, which are not user inputs; "
                f"the program's user inputs are {sorted(user_inputs)}"
            )
        self._check_against_inputs()
        declared = {
            user_inputs[name]: ValueRange(low, high, Source.DECLARED)
            for name, (low, high) in self.input_ranges.items()
        }
        state = {slot.placeholder: slot.target for slot in self.program.state_slots()}
        rules = RangeRules(self.program.range_constraints())
        boundaries = Facts.of(graph_module).boundaries
        walk = _Walk(self.program, boundaries, declared, state, rules)
        forward = walk.forward(graph_module, {})
        bounds = index_bounds(graph_module.graph, _known(forward), rules.size_bound)
        if bounds:
            confined = {node: ValueRange(*bound, Source.PROVEN) for node, bound in bounds.items()}
            walk = _Walk(self.program, boundaries, declared, state, rules)
            # only what the bounds reach can change (into bodies too: then all of it)
            reached = None if boundaries.looked_into else _downstream(confined)
            walk.forward(graph_module, confined, reached)
        return PassResult(graph_module, False)

    def _check_against_inputs(self) -> None:
        """``InvalidOptionError`` for a range declared on a float input: ranges are for
        integers."""
        for placeholder in self.program.user_input_placeholders():
            val = placeholder.meta.get("val")
            declared = placeholder.name in self.input_ranges
            if declared and isinstance(val, torch.Tensor) and val.is_floating_point():
                raise InvalidOptionError(
                    f"input_ranges[{placeholder.name!r}]: {placeholder.name!r} is a float input "
                    f"({dtype_name(val.dtype)}); input_ranges declares integer inputs' ranges"
                )


class _Walk:
    """One walk in graph order over a graph and, at each higher-order op, its bodies
    (each once): a body's placeholder has the range its operands have (the union over
    the ops that share the body; none for a value a loop carries), an op's result
    the union of its bodies' outputs."""

    def __init__(self, program, boundaries, declared, state, rules) -> None:
        self.program, self.boundaries = program, boundaries
        self.declared, self.state, self.rules = declared, state, rules
        self.walked: set[int] = set()

    def forward(self, graph_module: GraphModule, confined: dict, reached=None) -> dict:
        """Range every node of ``graph_module``; ``confined``: ranges proven by use as an
        index, intersected with what the walk finds; ``reached``: the only nodes whose
        range may differ from the one recorded (None: all). Returns the ranges found
        (of the nodes walked)."""
        found_by_node = {}
        for node in graph_module.graph.nodes:
            if reached is not None and node not in reached:
                continue
            sources = self.boundaries.crossing_sources(node)
            if not sources and _float_op(node) and node not in confined:
                node.meta.pop(ValueRangeAnalysis.META_KEY, None)  # no integer range to find
                continue
            if node.op == "placeholder" and node in self.state:
                found = self.rules.of_state(self.program.state_tensor(self.state[node]))
            elif sources:
                found = union([value_range(source) for source in sources])
            elif node.op == "placeholder":
                found = self.declared.get(node) or self.rules.of_bool(node)
            elif node in self.boundaries.looked_into:
                self.bodies(graph_module, node)
                continue
            elif node.op == "call_function":
                found = _within_dtype(node, self.rules.of(node))
            else:
                continue
            found = _intersect(found, confined.get(node))
            observed = meta.observed_int_range(node)
            if found is None and observed is not None:
                found = ValueRange(*observed, Source.OBSERVED)
            if found is None:
                node.meta.pop(ValueRangeAnalysis.META_KEY, None)
            else:
                found_by_node[node] = found
                node.meta[ValueRangeAnalysis.META_KEY] = found  # later rules read it
        return found_by_node

    def bodies(self, graph_module: GraphModule, node: Node) -> None:
        for body in bodies_and_operands(node)[0]:
            module = getattr(graph_module, body.target)
            if id(module) not in self.walked:
                self.walked.add(id(module))
                self.forward(module, {})


def _float_op(node: Node) -> bool:
    """An op whose value is a float tensor (a higher-order op's is a tuple)."""
    val = node.meta.get("val")
    return node.op == "call_function" and isinstance(val, torch.Tensor) and val.is_floating_point()


def _downstream(nodes) -> set[Node]:
    """``nodes`` and every node that reads them, directly or not, up to float ops (whose
    integer range is none whatever their inputs hold)."""
    reached, pending = set(nodes), list(nodes)
    while pending:
        for user in pending.pop().users:
            if user not in reached and not _float_op(user):
                reached.add(user)
                pending.append(user)
    return reached


def _intersect(found, bound: ValueRange | None):
    if bound is None or isinstance(found, tuple):
        return found
    if found is None:
        return bound
    return ValueRange(max(found.low, bound.low), min(found.high, bound.high), found.source)


def _known(ranges: dict):
    def known(arg) -> tuple[float, float] | None:
        found = ranges.get(arg) if isinstance(arg, Node) else value_range(arg)
        return (found.low, found.high) if isinstance(found, ValueRange) else None

    return known


def _within_dtype(node: Node, found: ValueRange | tuple | None) -> ValueRange | tuple | None:
    """Drop a range the node's own dtype cannot hold: the program wraps there, so the
    true values are unknown (and no narrowing can be justified)."""
    val = node_val(node)
    if isinstance(found, ValueRange) and isinstance(val, torch.Tensor):
        if val.dtype in INT_DTYPES and not found.fits(val.dtype):
            return None
    return found
