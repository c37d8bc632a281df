"""The float oracle: how far a rewritten program's float outputs may lie from the original's.

A pass that keeps every dtype must keep float outputs within fp32 tolerance of the
original program's. A cast (a pass after which more nodes compute in a 16-bit float
dtype) is held to an emulation of itself: the original program run in fp32, node by
node, with every value rounded to the 16-bit dtype where the cast program computes the
node of the same name in 16-bit, and every other value kept as computed (the weights
and inputs likewise); a custom op the cast feeds 16-bit runs in 16-bit, since what it
rounds inside no rounding of its result shows, and a value kept fp32 is rounded on the
way into each op whose namesake reads a 16-bit copy of it. Its error against the
original is what 16-bit rounding alone costs where the cast put 16-bit; the cast may
lose a small multiple of that, plus a few roundings of the output itself, and no more.
A pass that computes wrong floats (a multiply made an add, a scalar dropped) lands far
outside the bound whatever it kept in fp32; an emulation that overflows where fp32
does not bounds nothing, and such an output is left to the inf/nan check.

fp32 is the reference because it is the exact result to within fp32's rounding, except
where fp32 overflows inside and its output is an artifact (a row of 1e38 whose RMS norm
squares it to inf gives 0; the norm of a constant row is 1). A cast that computes such
a value stably (fx16's stable rewrites) gives the exact result instead: an output off
fp32 but within the same bound of the program run in fp64 (``exact_outputs``), where
fp32 itself lies beyond that bound of it, passes.

The oracle shares no code with the passes it checks: it reads the cast program's
dtypes and names, never fx16's decisions, and the emulation runs the original graph.
"""

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.fx import GraphModule, Node

from fx16.analysis.emulation import Emulation
from fx16.ops.numerics import INF_LIKE
from fx16.ops.tables import is_custom_op
from fx16.program import Program
from fx16.program.interpreter import BodyInterpreter
from fx16.program.nodes import SIXTEEN_BIT_DTYPES, is_float_tensor, node_val, tensor_leaves

# a dtype-preserving pass: max |error| / max |output| over the output's ordinary values
FP32_TOLERANCE = 1e-4
# a cast: within this multiple of its emulation's error, plus a few roundings (a
# rounding: half the 16-bit dtype's eps)
EMULATED_FACTOR = 4
OUTPUT_ROUNDINGS = 4


def narrowed_dtype(original: ExportedProgram, cast: ExportedProgram) -> torch.dtype | None:
    """The 16-bit float dtype more nodes compute in after the rewrite than before (the
    cast's dtype), or None for a rewrite that narrows nothing."""
    before, after = _sixteen_bit_counts(original), _sixteen_bit_counts(cast)
    grown = {dtype: after[dtype] - before[dtype] for dtype in SIXTEEN_BIT_DTYPES}
    dtype = max(grown, key=grown.get)
    return dtype if grown[dtype] > 0 else None


def _sixteen_bit_counts(ep: ExportedProgram) -> dict[torch.dtype, int]:
    counts = dict.fromkeys(SIXTEEN_BIT_DTYPES, 0)
    for module in _graph_modules(ep).values():
        for node in module.graph.nodes:
            for leaf in tensor_leaves(node_val(node)):
                if leaf.dtype in counts:
                    counts[leaf.dtype] += 1
    return counts


def _graph_modules(ep: ExportedProgram) -> dict[str, GraphModule]:
    return {
        name: module
        for name, module in ep.graph_module.named_modules()
        if isinstance(module, GraphModule)
    }


def _with_namesakes(original: ExportedProgram, cast: ExportedProgram):
    """Each node of ``original`` (bodies included) with its namesake in ``cast``: the
    node of the same name in the graph of the same name (None where there is none)."""
    cast_modules = _graph_modules(cast)
    for name, module in _graph_modules(original).items():
        namesakes = {node.name: node for node in cast_modules.get(name, module).graph.nodes}
        for node in module.graph.nodes:
            yield node, namesakes.get(node.name)


def kept_wide(original: ExportedProgram, cast: ExportedProgram) -> set[Node]:
    """The nodes of ``original`` whose namesakes in ``cast`` compute no 16-bit float."""
    wide = set()
    for node, namesake in _with_namesakes(original, cast):
        leaves = tensor_leaves(node_val(namesake)) if namesake is not None else []
        if leaves and not any(leaf.dtype in SIXTEEN_BIT_DTYPES for leaf in leaves):
            wide.add(node)
    return wide


def other_sixteen_bit(
    original: ExportedProgram, cast: ExportedProgram, low: torch.dtype
) -> dict[Node, torch.dtype]:
    """The nodes of ``original`` whose namesakes in ``cast`` compute in a 16-bit float
    dtype other than ``low`` (an fp16 cast's bf16 ops), with that dtype."""
    found = {}
    for node, namesake in _with_namesakes(original, cast):
        leaves = tensor_leaves(node_val(namesake)) if namesake is not None else []
        dtypes = {leaf.dtype for leaf in leaves}
        if len(dtypes) == 1 and dtypes <= set(SIXTEEN_BIT_DTYPES) - {low}:
            found[node] = dtypes.pop()
    return found


def custom_ops_fed_16_bit(original: ExportedProgram, cast: ExportedProgram) -> frozenset[Node]:
    """The custom ops (outside aten and prims) of ``original`` whose namesakes in
    ``cast`` read a 16-bit float tensor: their kernels compute in it, and only running
    them so emulates what they round inside (a quantizer's quotient rounded to 16-bit
    before it rounds to an integer moves a code by one step)."""
    fed = set()
    for node, namesake in _with_namesakes(original, cast):
        if namesake is None or not is_custom_op(node.target):
            continue
        inputs = [leaf for n in namesake.all_input_nodes for leaf in tensor_leaves(node_val(n))]
        if any(leaf.dtype in SIXTEEN_BIT_DTYPES for leaf in inputs):
            fed.add(node)
    return frozenset(fed)


def narrowed_reads(
    original: ExportedProgram, cast: ExportedProgram
) -> dict[Node, dict[Node, torch.dtype]]:
    """For each node of ``original``, the fp32 values it reads whose places in its
    namesake's arguments in ``cast`` hold a 16-bit float, with that dtype: the cast
    rounds them on the way in (an input kept fp32 for one reader, a 16-bit copy of it
    for another)."""
    reads = {}
    for node, namesake in _with_namesakes(original, cast):
        if namesake is None or namesake.target != node.target:
            continue
        ours = pytree.tree_leaves((node.args, node.kwargs))
        theirs = pytree.tree_leaves((namesake.args, namesake.kwargs))
        if len(ours) != len(theirs):  # arguments that do not line up: nothing to say
            continue
        narrowed = {
            value: node_val(read).dtype
            for value, read in zip(ours, theirs)
            if isinstance(value, Node)
            and isinstance(read, Node)
            and _holds(value, (torch.float32,))
            and _holds(read, SIXTEEN_BIT_DTYPES)
            and isinstance(node_val(read), torch.Tensor)
        }
        if narrowed:
            reads[node] = narrowed
    return reads


def _holds(node: Node, dtypes) -> bool:
    leaves = tensor_leaves(node_val(node))
    return bool(leaves) and all(leaf.dtype in dtypes for leaf in leaves)


def emulated_outputs(
    original: ExportedProgram, cast: ExportedProgram, args: tuple, low: torch.dtype
) -> list:
    """``original``'s user outputs on ``args``, run with 16-bit rounding where ``cast``
    computes in 16-bit (``kept_wide`` rounds nothing)."""
    program = Program.of(original)
    emulation = Emulation(
        program,
        [(tuple(args), {})],
        low,
        round_weights=True,
        run_in_low=custom_ops_fed_16_bit(original, cast),
        narrowed_reads=narrowed_reads(original, cast),
        rounded_as=other_sixteen_bit(original, cast, low),
    )
    leaves = emulation.outputs(emulation.calls[0], kept_wide(original, cast))
    specs = original.graph_signature.output_specs
    return [leaf for leaf, spec in zip(leaves, specs) if spec.kind == OutputKind.USER_OUTPUT]


def output_error(want: torch.Tensor, have: torch.Tensor) -> float:
    """max |want - have| / max |want| over ``want``'s ordinary values (finite, below the
    infinity-like sentinels a cast may saturate), in fp64; inf where ``have`` is not
    finite there."""
    ordinary = torch.isfinite(want) & (want.abs() < INF_LIKE)
    if not bool(ordinary.any()):
        return 0.0
    want, have = want[ordinary].double(), have[ordinary].double()
    if not bool(torch.isfinite(have).all()):
        return float("inf")
    difference = (want - have).abs().max().item()
    scale = want.abs().max().item()
    return difference / scale if scale else difference


class _InFp64(BodyInterpreter):
    """Runs a graph with every fp32 tensor, and every fp32 a dtype argument names, in
    fp64; the graph's own dtype assertions are skipped (they name fp32)."""

    def inside(self, body: GraphModule) -> "_InFp64":
        return _InFp64(body)

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten._assert_tensor_metadata.default:
            return None
        args, kwargs = pytree.tree_map(_in_fp64, (args, kwargs))
        return super().call_function(target, args, kwargs)


def _in_fp64(value):
    if value is torch.float32:
        return torch.float64
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return value.double()
    return value


def exact_outputs(original: ExportedProgram, args: tuple) -> list:
    """``original``'s user outputs on ``args`` computed in fp64 wherever it computes
    fp32 (its own 16-bit values stay as they are), in fp32's dtypes."""
    program = Program.of(original)
    with torch.no_grad():
        inputs = program.graph_inputs(args, copy_buffers=True)
        leaves = pytree.tree_leaves(_InFp64(program.graph_module).run(*inputs))
    specs = original.graph_signature.output_specs
    return [
        leaf.float() if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float64 else leaf
        for leaf, spec in zip(leaves, specs)
        if spec.kind == OutputKind.USER_OUTPUT
    ]


def float_bounds(
    original: ExportedProgram, cast: ExportedProgram, args: tuple, expected: list
) -> list[float]:
    """For each output, the largest ``output_error`` the rewrite may show (inf where
    nothing bounds it: an integer output, or an emulation that overflows)."""
    low = narrowed_dtype(original, cast)
    if low is None:
        return [FP32_TOLERANCE if is_float_tensor(want) else float("inf") for want in expected]
    emulated = emulated_outputs(original, cast, args, low)
    flip = _coarser_flip(original, low)
    return [
        EMULATED_FACTOR * output_error(want, emulation.to(want.dtype))
        + OUTPUT_ROUNDINGS * _rounding(want, low)
        + flip
        if is_float_tensor(want)
        else float("inf")
        for want, emulation in zip(expected, emulated)
    ]


def _rounding(want: torch.Tensor, low: torch.dtype) -> float:
    """The most one rounding of ``want`` to ``low`` moves it, relative to its largest
    ordinary magnitude (``output_error``'s scale): half an eps of each value, or half
    the smallest subnormal where that is more. Values near or below the subnormal
    range round in steps of the subnormal: there a 16-bit program is off by a
    subnormal however it computes (a guard ``0 + 1e-9`` kept at the subnormal rather
    than flushed), and that is nothing relative to an output of ordinary size."""
    info = torch.finfo(low)
    ordinary = torch.isfinite(want) & (want.abs() < INF_LIKE)
    scale = want[ordinary].abs().max().item() if bool(ordinary.any()) else 0.0
    half_subnormal = info.tiny * info.eps / 2
    return max(info.eps / 2, half_subnormal / scale) if scale else info.eps / 2


def _coarser_flip(original: ExportedProgram, low: torch.dtype) -> float:
    """One ulp (relative) of the coarsest 16-bit dtype the original program rounds values
    to itself, where it is coarser than ``low`` (a model's own bf16 copy in a program cast
    to fp16), else 0: a value the cast computes an ulp of ``low`` away from the
    emulation's may round to that coarser type the other way, a whole ulp of it that
    no emulation can foresee."""
    eps = torch.finfo(low).eps
    held = [dtype for dtype, count in _sixteen_bit_counts(original).items() if count]
    coarser = [torch.finfo(dtype).eps for dtype in held if torch.finfo(dtype).eps > eps]
    return max(coarser, default=0.0)


def check_floats(
    original: ExportedProgram, cast: ExportedProgram, args: tuple, expected: list, got: list
) -> int:
    """Assert every float output of ``cast`` lies within its bound (``float_bounds``) of
    ``original``'s, or, where fp32 is itself beyond that bound of the exact result
    (``exact_outputs``: it overflowed inside), of the exact result; returns how many
    outputs a finite bound checked."""
    checked, exact = 0, None
    for index, (bound, want, have) in enumerate(
        zip(float_bounds(original, cast, args, expected), expected, got)
    ):
        if bound == float("inf"):
            continue
        error = output_error(want, have.to(want.dtype))
        if error > bound:
            exact = _exact_if_runnable(original, args) if exact is None else exact
            if exact and output_error(exact[index], want) > bound:
                error = min(error, output_error(exact[index], have.to(want.dtype)))
        assert error <= bound, (
            f"float output {index} is {error:.3g} off the original (max |error| / max "
            f"|output|), beyond its bound {bound:.3g}: {_worst(want, have)}"
        )
        checked += 1
    return checked


def _exact_if_runnable(original: ExportedProgram, args: tuple) -> list:
    """``exact_outputs``, or [] where the program cannot run in fp64 (a kernel without
    an fp64 version, such as an int8 weight's packed matmul): then fp32 is the only
    reference."""
    try:
        return exact_outputs(original, args)
    except Exception:  # whatever the kernel raises: no fp64 reference to offer
        return []


def _worst(want: torch.Tensor, have: torch.Tensor) -> str:
    ordinary = torch.isfinite(want) & (want.abs() < INF_LIKE)
    difference = torch.where(ordinary, (want.double() - have.double()).abs(), 0.0)
    position = tuple(int(i) for i in torch.unravel_index(difference.argmax(), want.shape))
    return f"at {position} expected {want[position].item():.6g}, got {have[position].item():.6g}"
