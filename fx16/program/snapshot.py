"""Snapshots of a program: what a cast changes, saved so that a failed cast can be undone.

``Program.snapshot`` and ``Program.transaction`` use them; a snapshot holds the graphs
(node by node, shallowly), the state dicts (by weak reference once released), the output
specs' names, the example inputs and the graph module's meta.
"""

import contextlib
import copy
import gc
import weakref
from collections.abc import Iterator

import torch
from torch.export.graph_signature import TensorArgument
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

# graph_module.meta key: the state tensors decided for 16-bit but not converted yet
# (target -> (dtype, whether an element may flush)), which the program changes in place.
PENDING = "fx16.pending_state"


def _arg_name(spec) -> str | None:
    return spec.arg.name if isinstance(spec.arg, TensorArgument) else None


def _copied_meta(meta: dict) -> dict:
    """A graph module's meta, with its own copy of the pending conversions (the one
    entry the program changes in place)."""
    return {key: dict(value) if key == PENDING else value for key, value in meta.items()}


class _Released:
    """A saved state tensor held by weak reference, with the dtype it had."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ref, self.dtype = weakref.ref(tensor), tensor.dtype


def _weak(value):
    return _Released(value) if isinstance(value, torch.Tensor) else value


def _strong(saved, current):
    """A saved state entry, dereferenced; a freed tensor comes back in its own dtype
    from the tensor now in its place (an fp32 or bf16 original from its 16-bit copy:
    exact for the values it holds)."""
    if not isinstance(saved, _Released):
        return saved
    original = saved.ref()
    if original is not None:
        return original
    widened = current.detach().to(saved.dtype)
    return (
        torch.nn.Parameter(widened, current.requires_grad)
        if isinstance(current, torch.nn.Parameter)
        else widened
    )


class Snapshot:
    """The graphs (the program's and its subgraphs'), state_dict, constants, graph
    signature and example inputs of a program at one moment."""

    def __init__(self, program) -> None:
        ep = self._ep = program.ep
        self._graph_module = program.graph_module
        self._graphs = {
            name: _GraphRecord(module.graph)
            for name, module in self._graph_module.named_modules()
            if isinstance(module, GraphModule)
        }
        self._state_dict, self._constants = dict(ep.state_dict), dict(ep.constants)
        self.released = False
        # a cast changes only which node each output spec names (``sync_output_specs``)
        self._signature = ep.graph_signature
        self._output_names = [_arg_name(spec) for spec in ep.graph_signature.output_specs]
        self._example_inputs = ep.example_inputs
        self._meta = _copied_meta(self._graph_module.meta)

    def release_state(self) -> None:
        """Hold the saved state tensors by weak reference only, so that replacing one in
        the program frees it unless the caller holds it too."""
        self._state_dict, self._constants = (
            {key: _weak(value) for key, value in saved.items()}
            for saved in (self._state_dict, self._constants)
        )
        self.released = True

    def restore(self) -> None:
        """Put the program back as it was (a fresh copy each time, so it can be repeated).

        After ``release_state``, a tensor nobody else held is gone: its 16-bit
        replacement is widened back to fp32 (exact for the values it holds)."""
        ep = self._ep
        for name, module in self._graph_module.named_modules():
            if name in self._graphs:
                module.graph = self._graphs[name].rebuild()  # also recompiles
        for store, saved in ((ep.state_dict, self._state_dict), (ep.constants, self._constants)):
            current = dict(store)
            store.clear()
            store.update({key: _strong(value, current.get(key)) for key, value in saved.items()})
        ep._graph_signature = self._signature
        for spec, name in zip(self._signature.output_specs, self._output_names):
            if name is not None:
                spec.arg.name = name
        ep._example_inputs = self._example_inputs
        self._graph_module.meta.clear()
        self._graph_module.meta.update(_copied_meta(self._meta))


class _GraphRecord:
    """What each node of a graph was (op, target, arguments, name, meta), from which
    ``rebuild`` makes an equal graph.

    Recording is a shallow copy per node, as cheap as a snapshot can be: passes
    replace a node's arguments and meta entries but never mutate them in place, and
    the recorded arguments name the original nodes only to say which record feeds
    which. (A deep copy of the graph took 15% of a cast's time, to protect against
    failures that almost never happen.)"""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self._tracer_cls = graph._tracer_cls
        self._codegen = copy.deepcopy(graph._codegen)
        self._nodes = [
            (
                node,
                node.op,
                node.target,
                node.args,
                node.kwargs,
                node.name,
                node.type,
                dict(node.meta),
            )
            for node in graph.nodes
        ]

    def rebuild(self) -> torch.fx.Graph:
        graph = torch.fx.Graph(tracer_cls=self._tracer_cls)
        copies: dict[Node, Node] = {}
        for original, op, target, args, kwargs, name, type_expr, meta in self._nodes:
            copy_ = graph.create_node(
                op,
                target,
                map_arg(args, copies.__getitem__),
                map_arg(kwargs, copies.__getitem__),
                name,
                type_expr,
            )
            if copy_.name != name:  # the namespace renames builtins ("input"): the
                copy_.name = name  # signature names the node as export did
            copy_.meta = dict(meta)
            copies[original] = copy_
        graph._codegen = copy.deepcopy(self._codegen)
        return graph


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a block (a decorator too). fx16 makes many
    small objects; each collection they trigger walks the caller's whole heap, graphs
    and all, which on a large program costs as much as the cast's own work."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
