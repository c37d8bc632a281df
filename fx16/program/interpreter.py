"""Interpreters for analyses that look at every value: calibration, emulation, the budget."""

from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.node import map_arg

from fx16.program import narrow_reads
from fx16.program.subgraphs import AUTOCAST, COND, INVOKE_SUBGRAPH, MAP, SET_GRAD, WHILE_LOOP


class LeanInterpreter(Interpreter):
    """Runs a graph node by node, like ``torch.fx.Interpreter``, for analyses that look
    at every value (calibration, emulation, the accuracy search).

    ``Interpreter`` carries per node what nothing fx16 runs needs: ``run_node`` enters
    two context managers to record the node being run for tracebacks of code that
    traces while it runs, ``run`` updates a progress bar, each argument look-up checks
    that its value exists (a well-formed graph defines every value before its uses).
    On a 2,000-node graph these cost as much as the ops themselves; here a node costs
    one look-up per argument and one call. As ``Interpreter.run`` does, ``run`` frees
    each value after its last use, and names the failing node in the error it raises
    (a KeyError becomes a RuntimeError, as there).
    """

    def __init__(
        self,
        module: GraphModule,
        garbage_collect_values: bool = True,
        graph: torch.fx.Graph | None = None,
        last_uses: dict[Node, list[Node]] | None = None,
    ) -> None:
        """``last_uses``: ``last_uses(graph)``, from a caller that runs the same
        unchanged graph many times (computing it costs a walk of the graph per run)."""
        super().__init__(module, garbage_collect_values and last_uses is None, graph)
        if garbage_collect_values and last_uses is not None:
            self.garbage_collect_values, self.user_to_last_uses = True, last_uses
        # placeholders handed narrower than the graph reads them: the dtype it reads
        self.widened: dict[Node, torch.dtype] = {}

    def run(self, *args, initial_env=None, enable_io_processing: bool = True) -> Any:
        self.env = env = {} if initial_env is None else initial_env
        if enable_io_processing:
            args = self.graph.process_inputs(*args)
        self.args_iter = iter(args)
        last_uses = self.user_to_last_uses if self.garbage_collect_values else {}
        for node in self.graph.nodes:
            if node in env:  # given in initial_env
                continue
            try:
                env[node] = self.run_node(node)
                if node.op == "placeholder" and (dtype := widened_dtype(node, env[node])):
                    self.widened[node] = dtype
            except Exception as error:
                _name_the_node(error, node)
                if isinstance(error, KeyError):
                    raise RuntimeError(*error.args) from error
                raise
            for value in last_uses.get(node, ()):
                del env[value]
            if node.op == "output":
                output = env[node]
                return self.graph.process_outputs(output) if enable_io_processing else output
        return None

    def run_node(self, node: Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        return getattr(self, node.op)(node.target, args, kwargs)

    def fetch_args_kwargs_from_env(self, node: Node) -> tuple[tuple, dict]:
        value_of = self.reader_of(node)
        return map_arg(node.args, value_of), map_arg(node.kwargs, value_of)

    def reader_of(self, node: Node) -> Callable[[Node], Any]:
        """How ``node`` reads a value: from the env; a placeholder handed narrower than
        its metadata says (a bf16 checkpoint's weight, pending widening:
        ``Program.graph_inputs`` with ``widen=False``) widened for this read only, or
        for an op that reads it by blocks, as a ``fx16.program.narrow_reads.NarrowRead``:
        no whole fp32 copy of a weight is made."""
        if not self.widened:
            return self.env.__getitem__
        env, widened = self.env, self.widened
        by_blocks = node.target in narrow_reads.READERS
        return lambda value: narrow_reads.as_read(env[value], widened.get(value), by_blocks)

    def call_function(self, target, args, kwargs) -> Any:
        if self.widened and target in narrow_reads.READERS:
            return narrow_reads.call(target, args, kwargs)
        return target(*args, **kwargs)


def widened_dtype(placeholder: Node, value: Any) -> torch.dtype | None:
    """The dtype the graph reads ``placeholder`` in, where ``value`` is handed narrower
    (a state tensor pending widening, ``Program.graph_inputs`` with ``widen=False``);
    None where it is handed as read."""
    val = placeholder.meta.get("val")
    if (
        isinstance(value, torch.Tensor)
        and isinstance(val, torch.Tensor)
        and value.is_floating_point()
        and val.dtype.is_floating_point
        and value.dtype.itemsize < val.dtype.itemsize
    ):
        return val.dtype
    return None


def last_uses(graph: torch.fx.Graph) -> dict[Node, list[Node]]:
    """For each node, the values it is the last to read (freed once it has run)."""
    last_reader: dict[Node, Node] = {}
    freed: dict[Node, list[Node]] = {}
    for node in reversed(graph.nodes):
        for value in node.all_input_nodes:
            if value not in last_reader:
                last_reader[value] = node
                freed.setdefault(node, []).append(value)
    return freed


def _name_the_node(error: Exception, node: Node) -> None:
    """Add to ``error``'s message the node that raised it, as ``Interpreter.run`` does."""
    where = f"While executing {node.format_node()}\nOriginal traceback:\n{node.stack_trace}"
    error.args = (f"{error.args[0]}\n\n{where}", *error.args[1:]) if error.args else (where,)


class BodyInterpreter(LeanInterpreter):
    """A LeanInterpreter that runs the bodies of higher-order ops node by node too:
    cond (the branch taken), while_loop (every iteration), map (every slice),
    autocast and set_grad_enabled regions, invoke_subgraph; each body by a new
    interpreter from ``inside`` (a subclass shares its records with it). Other
    higher-order ops run whole."""

    def inside(self, body: GraphModule) -> "BodyInterpreter":
        """The interpreter that runs ``body`` for this one."""
        raise NotImplementedError

    def call_function(self, target, args, kwargs):
        runs = body_runs(target, args, regions=True)
        if runs is None:
            return super().call_function(target, args, kwargs)
        try:
            body, operands = next(runs)
            while True:
                body, operands = runs.send(self.inside(body).run(*operands))
        except StopIteration as done:
            return done.value


def body_runs(target, args, regions: bool) -> Generator[tuple, Any, Any] | None:
    """How a higher-order op runs its bodies, as a generator: it yields ``(body,
    operands)`` for each body run, is sent that run's outputs, and returns the op's
    result. cond runs the branch taken, while_loop every iteration, map every slice,
    invoke_subgraph its body; with ``regions``, autocast and set_grad_enabled regions
    too (their mode is set around the body's run). None for an op run whole.

    One statement of the ops' semantics for every interpreter that runs bodies node
    by node (``BodyInterpreter``, ``fx16.program.values``)."""
    if target in (COND, WHILE_LOOP, INVOKE_SUBGRAPH) or (target is MAP and args[1][0].shape[0]):
        return _runs(target, args)
    if regions and target in (AUTOCAST, SET_GRAD):
        return _runs(target, args)
    return None


def _runs(target, args):
    if target is COND:
        predicate, true_body, false_body, operands = args
        return tuple((yield (true_body if bool(predicate) else false_body), operands))
    if target is WHILE_LOOP:
        condition, body, carried, additional = args
        carried = tuple(carried)
        while bool(pytree.tree_leaves((yield condition, (*carried, *additional)))[0]):
            carried = tuple((yield body, (*carried, *additional)))
        return carried
    if target is MAP:
        body, mapped, others = args
        slices = []
        for index in range(mapped[0].shape[0]):
            slices.append((yield body, (*(tensor[index] for tensor in mapped), *others)))
        return [torch.stack(parts) for parts in zip(*slices)]
    if target is AUTOCAST:
        device, dtype, enabled, _, body, *operands = args
        with torch.autocast(device_type=device, dtype=dtype, enabled=enabled):
            return tuple((yield body, operands))
    if target is SET_GRAD:
        enabled, body, *operands = args
        with torch.set_grad_enabled(enabled):
            return tuple((yield body, operands))
    body, _, *operands = args  # invoke_subgraph
    return tuple((yield body, operands))
