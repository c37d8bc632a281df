"""The fp32 program run as a 16-bit cast computes it, without casting it: to measure a verdict.

A verdict that keeps something in fp32 is worth its cost only if fp32 measurably
lowers the output error. Measuring that on the cast program means casting it once
per verdict; instead the emulator runs the fp32 program (an interpreter, into
higher-order ops' bodies too) and rounds every float value an op produces, and
every float user input, to the 16-bit dtype - except the values kept ``wide``, and
the results of data movement and in-place ops (already rounded, and possibly views
a later in-place op writes through) - so
overflow to inf, flushing to zero and rounding all happen where the cast program
has them (an op computed in 16-bit reads a value kept wide rounded where the cast
program reads it through a cast); an infinity-like sentinel (|x| >= 1e38) saturates
to the 16-bit maximum, as fx16 makes it. Ops compute from rounded inputs in fp32, as
16-bit kernels on CPUs and GPUs accumulate in fp32. Weights enter exact: their
rounding is the same with or without any verdict, and rounding copies of them would
double their memory.
"""

import operator
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from fx16 import meta
from fx16.analysis.replay import replay_reconverges
from fx16.ops.kinds import OpKind, op_kind
from fx16.ops.numerics import INF_LIKE, largest
from fx16.program import Program
from fx16.program.interpreter import BodyInterpreter, LeanInterpreter, last_uses
from fx16.program.narrow_reads import NarrowRead, whole
from fx16.program.nodes import mutated_argument
from fx16.program.stats import outputs_error
from fx16.program.subgraphs import nested_graph_modules


class _Emulator(BodyInterpreter):
    def __init__(self, graph_module: GraphModule, emulation: "Emulation", wide: set[Node]):
        super().__init__(graph_module, last_uses=emulation.last_uses(graph_module))
        self.emulation, self.wide = emulation, wide

    def inside(self, body: GraphModule) -> "_Emulator":
        return _Emulator(body, self.emulation, self.wide)

    def fetch_args_kwargs_from_env(self, node: Node) -> tuple[tuple, dict]:
        narrowed = self.emulation.narrowed_reads.get(node)
        from_wide = self.emulation.reads_rounded(node, self.wide)
        if not narrowed and not from_wide:
            return super().fetch_args_kwargs_from_env(node)
        read, rounded = self.reader_of(node), self.emulation.rounded
        narrowed = narrowed or {}

        def value_of(value: Node):
            if value in narrowed:
                return rounded(value, read(value), narrowed[value])
            return rounded(value, read(value)) if value in from_wide else read(value)

        return map_arg(node.args, value_of), map_arg(node.kwargs, value_of)

    def run_node(self, node: Node):
        if node in self.emulation.run_in_low:  # fed 16-bit, whatever dtype it returns
            return self.emulation.run_in_low_dtype(node, *self.fetch_args_kwargs_from_env(node))
        result = super().run_node(node)
        if node not in self.emulation.rounding or node in self.wide:
            return result
        return self.emulation.rounded(node, result)


def _rounded(value, low: torch.dtype, may_hold_sentinels: bool):
    """``value`` with its fp32 tensors rounded to ``low``; an infinity-like sentinel
    saturates to ``low``'s maximum, as fx16 makes it. A weight read by blocks is rounded
    as each block is read."""
    if isinstance(value, NarrowRead):
        return value.then(lambda tensor: _rounded_tensor(tensor, low, may_hold_sentinels))
    if isinstance(value, torch.Tensor):
        return _rounded_tensor(value, low, may_hold_sentinels)
    if isinstance(value, (list, tuple)):
        return pytree.tree_map(
            lambda leaf: (
                _rounded_tensor(leaf, low, may_hold_sentinels)
                if isinstance(leaf, torch.Tensor)
                else leaf
            ),
            value,
        )
    return value


def _rounded_tensor(tensor: torch.Tensor, low: torch.dtype, may_hold_sentinels: bool):
    if tensor.dtype != torch.float32:
        return tensor
    rounded = _NARROW[low](tensor)  # .half() is cheaper to call than .to(dtype)
    if may_hold_sentinels and not bool(torch.isfinite(rounded).all()):
        top = largest(low)
        sentinel = (tensor.abs() >= INF_LIKE) & torch.isfinite(tensor)
        rounded = torch.where(sentinel, tensor.clamp(-top, top), tensor).to(low)
    return rounded.float()


_NARROW = {torch.float16: torch.Tensor.half, torch.bfloat16: torch.Tensor.bfloat16}


def _computes(node: Node) -> bool:
    """An op that computes values: not one that moves them (it may return a view of
    its input that a later in-place op writes through), not an in-place op, not the
    unpacking of a result already rounded."""
    return (
        node.op == "call_function"
        and op_kind(node) != OpKind.DATA_MOVEMENT
        and node.target is not operator.getitem
        and mutated_argument(node) is None
    )


class Emulation:
    """The fp32 program's outputs on the calibration calls, and the error of an
    emulated 16-bit run against them."""

    def __init__(
        self,
        program: Program,
        calls: list[tuple[tuple, dict]],
        low: torch.dtype,
        round_weights: bool = False,
        reference: list[list] | None = None,
        run_in_low: frozenset[Node] = frozenset(),
        narrowed_reads: dict[Node, dict[Node, torch.dtype]] | None = None,
        rounded_as: dict[Node, torch.dtype] | None = None,
        cast_down: Callable[[Node], bool] | None = None,
    ):
        """``round_weights``: round the state tensors too, for the error of the whole
        16-bit program rather than a comparison of verdicts. ``reference``: the fp32
        program's outputs on the calls, when known (calibration records them).
        ``run_in_low``: ops run in the 16-bit dtype itself rather than rounded after,
        for ops whose arithmetic no rounding of their result reproduces (a custom op
        computes in its inputs' dtype: ``(x / scale).round()`` rounds the quotient
        before it rounds to an integer), where the caller knows the cast feeds them
        16-bit (whatever they return: ``wide`` does not keep them fp32).
        ``narrowed_reads``: for an op, the values it reads rounded (to the 16-bit dtype
        given) though they are kept wide (a cast program that keeps x fp32 for one reader
        and feeds another a 16-bit copy: rounding only what ops produce would hand that
        one x itself).
        ``rounded_as``: nodes rounded to another 16-bit dtype than ``low`` (the ops an
        fp16 cast computes in bf16).
        ``cast_down``: which of the values kept wide an op computed in 16-bit reads
        through a cast to 16-bit (the others make their readers compute in fp32 too);
        None: each is read as it is."""
        self.program, self.low, self.calls = program, low, calls
        self.cast_down = cast_down
        self.rounded_as = rounded_as or {}
        self.run_in_low = run_in_low
        self.narrowed_reads = narrowed_reads or {}
        rounded_inputs = set(program.user_input_placeholders())
        if round_weights:
            rounded_inputs |= {slot.placeholder for slot in program.state_slots()}
        modules = nested_graph_modules(program.graph_module)
        nodes = [node for module in modules for node in module.graph.nodes]
        # what the emulation rounds: the computing ops, the inputs (and weights) chosen
        self.rounding = {node for node in nodes if _computes(node)} | rounded_inputs
        # where a sentinel may need saturating: what calibration saw hold one (all, unseen)
        calibrated = meta.CALIBRATION_OUTPUTS in program.graph_module.meta
        self.sentinels = {n for n in nodes if meta.holds_sentinel(n)} if calibrated else None
        self._reference = reference
        self._last_uses: dict[GraphModule, dict] = {}  # the graph does not change meanwhile

    @property
    def reference(self) -> list[list]:
        """The fp32 program's outputs on the calls (run when first needed)."""
        if self._reference is None:
            with torch.no_grad():
                self._reference = [
                    pytree.tree_leaves(
                        LeanInterpreter(self.program.graph_module).run(*self.graph_inputs(call))
                    )
                    for call in self.calls
                ]
        return self._reference

    def graph_inputs(self, call: tuple[tuple, dict]) -> list:
        """Each run starts from the buffers' values (a program may update them in place);
        a tensor pending widening is handed as stored, widened as each run reads it."""
        return self.program.graph_inputs(*call, copy_buffers=True, widen=False)

    def error(self, wide: set[Node]) -> float:
        """The largest output error, over the calls, of a run that keeps ``wide`` in fp32."""
        errors = [
            outputs_error(reference, self.outputs(call, wide))
            for call, reference in zip(self.calls, self.reference)
        ]
        return max(errors, default=0.0)

    def outputs(self, call: tuple[tuple, dict], wide: set[Node]) -> list:
        """The graph's outputs, flattened, of one emulated run of ``call`` that keeps
        ``wide`` in fp32."""
        with torch.no_grad():
            emulator = _Emulator(self.program.graph_module, self, wide)
            return pytree.tree_leaves(emulator.run(*self.graph_inputs(call)))

    def changes_nothing(self, wide: set[Node], dropped: set[Node]) -> bool:
        """Whether rounding ``dropped`` too (a run keeping ``wide - dropped`` in fp32)
        leaves the outputs as they were, bit for bit, on every call: then their error is
        the same, and no whole run is needed to say fp32 buys nothing (``fx16.analysis.replay``)."""
        if not dropped:
            return False
        with torch.no_grad():
            return all(
                replay_reconverges(self, self.graph_inputs(call), wide, dropped)
                for call in self.calls
            )

    def last_uses(self, graph_module: GraphModule) -> dict[Node, list[Node]]:
        """``fx16.program.interpreter.last_uses`` of a graph the runs go through, computed once."""
        if graph_module not in self._last_uses:
            self._last_uses[graph_module] = last_uses(graph_module.graph)
        return self._last_uses[graph_module]

    def run_in_low_dtype(self, node: Node, args: tuple, kwargs: dict):
        """``node``'s op run as a 16-bit cast runs it: its fp32 tensors (rounded as the
        emulation rounds them) and fp32 dtype arguments in the 16-bit dtype; its 16-bit
        float results back in fp32."""

        def narrowed(value):
            value = whole(value)
            if value is torch.float32:
                return self.low
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                return self.rounded(node, value).to(self.low)
            return value

        def widened(value):
            if isinstance(value, torch.Tensor) and value.dtype == self.low:
                return value.float()
            return value

        args, kwargs = pytree.tree_map(narrowed, (args, kwargs))
        return pytree.tree_map(widened, node.target(*args, **kwargs))

    def reads_rounded(self, node: Node, wide: set[Node]) -> list[Node]:
        """The values kept ``wide`` that ``node``, computed in 16-bit, reads rounded: those
        ``cast_down`` names, as the cast program reads them through a cast (a cos reads
        its fp32 angle rounded: rounding only its result would hand it the exact angle)."""
        if self.cast_down is None or node in wide or node not in self.rounding:
            return []
        return [
            arg
            for arg in node.all_input_nodes
            if arg in wide and self._computed(arg) and self.cast_down(arg)
        ]

    def _computed(self, node: Node) -> bool:
        """A value the program computes or takes from its user (a weight enters exact)."""
        return node.op != "placeholder" or node in self.rounding

    def rounded(self, node: Node, value, low: torch.dtype | None = None):
        """``value``, computed by ``node``, as the emulation rounds it to the 16-bit dtype
        (``low``: that dtype, where not the node's own)."""
        sentinels = self.sentinels
        low = low or self.rounded_as.get(node, self.low)
        return _rounded(value, low, sentinels is None or node in sentinels)
