"""The view of an ExportedProgram that fx16 passes share.

This module is the only code that reads or writes an ExportedProgram's
``state_dict``, ``constants``, graph signature and example inputs. Passes get a
``Program`` in their constructor and touch program state only through it.
"""

import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    TensorArgument,
)
from torch.fx import GraphModule, Node

from fx16.errors import InvalidProgramError
from fx16.program.graph_repairs import register_missing_users, unshare_meta
from fx16.program.snapshot import PENDING, Snapshot
from fx16.program.state_commit import commit_narrowing, commit_pending
from fx16.program.transactions import DEFERRING, transaction

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


@dataclass(frozen=True)
class StateSlot:
    """A placeholder fed from the program's state: a parameter, buffer or constant."""

    placeholder: Node
    target: str  # the state_dict / constants key, e.g. "layers.0.weight"
    kind: InputKind


# The Program of each ExportedProgram that Program.of was asked for, while anything (a
# cast, a pass list) holds it. Weak on both sides: a Program holds its ExportedProgram,
# so a Program held here would keep every program fx16 ever touched alive, weights too.
_PROGRAMS: "weakref.WeakKeyDictionary[ExportedProgram, weakref.ref]" = weakref.WeakKeyDictionary()


class Program:
    """Reads and updates one ExportedProgram's state on behalf of the passes."""

    def __init__(self, ep: ExportedProgram) -> None:
        if not isinstance(ep, ExportedProgram):
            got = (
                f"a torch.fx.GraphModule ({type(ep).__name__}) without export metadata"
                if isinstance(ep, GraphModule)
                else type(ep).__name__
            )
            raise InvalidProgramError(
                f"fx16 expects a torch.export.ExportedProgram, got {got}"
                + (
                    "; export it first with torch.export.export(model, args)"
                    if isinstance(ep, torch.nn.Module)
                    else ""
                )
            )
        self.ep = ep
        register_missing_users(ep.graph_module)
        unshare_meta(ep.graph_module)
        self.repaired = ep.graph_module  # the graph module those repairs were made on

    @classmethod
    def of(cls, program: "Program | ExportedProgram") -> "Program":
        """``program`` itself, or the Program of an ExportedProgram: every pass takes
        either. One Program per program and graph: a cast's stages share it, and its
        repairs of the graph run once."""
        if isinstance(program, Program):
            return program
        found = _PROGRAMS.get(program) if isinstance(program, ExportedProgram) else None
        shared = found() if found is not None else None
        if shared is None or shared.repaired is not program.graph_module:
            shared = cls(program)
            _PROGRAMS[program] = weakref.ref(shared)
        return shared

    @property
    def graph_module(self) -> GraphModule:
        return self.ep.graph_module

    def _placeholders_by_name(self) -> dict[str, Node]:
        return {node.name: node for node in self.graph_module.graph.find_nodes(op="placeholder")}

    # ---- state -----------------------------------------------------------------

    def state_slots(self) -> list[StateSlot]:
        """Parameters, buffers and tensor constants, in signature order."""
        placeholders = self._placeholders_by_name()
        return [
            StateSlot(placeholders[spec.arg.name], spec.target, spec.kind)
            for spec in self.ep.graph_signature.input_specs
            if spec.kind in _STATE_KINDS and spec.arg.name in placeholders
        ]

    def state_tensor(self, target: str) -> torch.Tensor | None:
        """The tensor stored under ``target`` (state_dict first, then constants)."""
        for store in (self.ep.state_dict, self.ep.constants):
            value = store.get(target)
            if isinstance(value, torch.Tensor):
                return value
        return None

    def replace_state_tensor(self, target: str, tensor: torch.Tensor) -> torch.Tensor:
        """Store ``tensor`` under ``target``, keeping the Parameter wrapper if there was one.

        Returns what was stored; storing that same object under another name keeps
        the two names tied (one tensor, as tied weights were before).
        """
        store = self.ep.state_dict if target in self.ep.state_dict else self.ep.constants
        old = store[target]
        if isinstance(old, torch.nn.Parameter) and not isinstance(tensor, torch.nn.Parameter):
            tensor = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
        store[target] = tensor
        return tensor

    def add_constant(self, stem: str, tensor: torch.Tensor) -> Node:
        """A new tensor constant of the program, stored under an unused name that starts
        with ``stem``, and the placeholder that feeds it to the graph: placed after the
        program's other state and before the user inputs, as ``torch.export`` orders
        them, with a ``val`` of the program's fake mode."""
        ep, graph = self.ep, self.graph_module.graph
        taken = set(ep.state_dict) | set(ep.constants)
        target = next(f"{stem}{n}" for n in range(len(taken) + 1) if f"{stem}{n}" not in taken)
        specs = list(ep.graph_signature.input_specs)
        first_user = next(
            (index for index, spec in enumerate(specs) if spec.kind not in _STATE_KINDS),
            len(specs),
        )
        placeholders = list(graph.find_nodes(op="placeholder"))
        before = placeholders[first_user] if first_user < len(placeholders) else None
        if before is None:
            before = next((node for node in graph.nodes if node.op != "placeholder"), None)
        with graph.inserting_before(before):
            placeholder = graph.placeholder(f"c_{target}")
        fake_mode = detect_fake_mode([node.meta.get("val") for node in placeholders])
        # a constant's shape is static, as export records it (no symbols of its own)
        fake = (fake_mode or FakeTensorMode()).from_tensor(tensor, static_shapes=True)
        placeholder.meta["val"] = fake
        specs.insert(
            first_user,
            InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(placeholder.name), target),
        )
        ep.constants[target] = tensor
        ep._graph_signature = ExportGraphSignature(specs, ep.graph_signature.output_specs)
        return placeholder

    def store_state(self, target: str, dtype: torch.dtype, may_flush: bool = True) -> None:
        """Decide the dtype the tensor under ``target`` is stored in: narrowed (fp32 to
        16-bit) or widened (a bf16 checkpoint's tensor that the graph now reads as fp32).

        The conversion happens in ``commit_state``: at the end of the transaction when
        one is open, so that nothing is converted before every decision is made and the
        original is freed as soon as it is replaced. Until then a widened tensor stays
        as stored (``graph_inputs``). ``may_flush=False``: the tensor's interval shows
        that no nonzero element can flush to zero (``fx16.ops.numerics.interval_may_flush``):
        a plain copy, no check. Storing a tensor in the dtype it has drops what was pending.
        """
        pending = self.graph_module.meta.setdefault(PENDING, {})
        if self.state_tensor(target).dtype == dtype:
            pending.pop(target, None)
        else:
            pending[target] = (dtype, may_flush)

    @property
    def defers_state(self) -> bool:
        """Whether state conversions wait for the open transaction's commit."""
        return bool(self.graph_module.meta.get(DEFERRING))

    def state_dtype(self, target: str) -> torch.dtype | None:
        """The dtype ``target`` is stored in once pending conversions are committed."""
        pending = self.graph_module.meta.get(PENDING) or {}
        if target in pending:
            return pending[target][0]
        tensor = self.state_tensor(target)
        return tensor.dtype if tensor is not None else None

    def commit_state(self, progress: bool | None = False) -> None:
        """Convert every state tensor ``store_state`` decided on (``fx16.program.state_commit``:
        largest first, each original dropped as soon as its converted copy replaces it;
        a tensor stored under several names stays shared). ``progress``: a progress bar
        of the bytes converted on stderr (None: when stderr is a terminal)."""
        pending = self.graph_module.meta.pop(PENDING, None)
        if pending:
            commit_pending(self, pending, progress)

    def range_constraints(self) -> dict:
        """Bounds of the program's symbolic sizes (sympy symbol -> ValueRanges)."""
        return dict(self.ep.range_constraints)

    # ---- user inputs and outputs ---------------------------------------------------

    def user_input_placeholders(self) -> list[Node]:
        placeholders = self._placeholders_by_name()
        return [
            placeholders[spec.arg.name]
            for spec in self.ep.graph_signature.input_specs
            if spec.kind == InputKind.USER_INPUT and spec.arg.name in placeholders
        ]

    def output_node(self) -> Node:
        return self.graph_module.graph.output_node()

    def user_output_count(self) -> int:
        """How many outputs the program returns to its caller (state updates left out)."""
        specs = self.ep.graph_signature.output_specs
        return sum(spec.kind == OutputKind.USER_OUTPUT for spec in specs)

    def required_output_dtypes(self) -> dict[int, torch.dtype]:
        """Output positions whose dtype is fixed: mutations must match what they write to."""
        required = {}
        placeholders = self._placeholders_by_name()
        input_names = {spec.target: spec.arg.name for spec in self.ep.graph_signature.input_specs}
        for index, spec in enumerate(self.ep.graph_signature.output_specs):
            if spec.kind == OutputKind.BUFFER_MUTATION:
                dtype = self.state_dtype(spec.target)
                if dtype is not None:
                    required[index] = dtype
            elif spec.kind == OutputKind.USER_INPUT_MUTATION:
                placeholder = placeholders.get(input_names.get(spec.target, spec.target))
                val = placeholder.meta.get("val") if placeholder is not None else None
                if isinstance(val, torch.Tensor):
                    required[index] = val.dtype
        return required

    def sync_output_specs(self) -> None:
        """Point each output spec at the node the graph now returns in its position."""
        returned = self.output_node().args[0]
        for spec, value in zip(self.ep.graph_signature.output_specs, returned):
            if isinstance(spec.arg, TensorArgument) and isinstance(value, Node):
                spec.arg.name = value.name

    def adapt_call(self, args: tuple, kwargs: dict | None = None) -> tuple[tuple, dict]:
        """``args``/``kwargs`` with each user tensor converted to its input's current dtype."""
        placeholders = iter(self.user_input_placeholders())
        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
        adapted = []
        for value in flat:
            placeholder = next(placeholders, None)
            val = placeholder.meta.get("val") if placeholder is not None else None
            if isinstance(value, torch.Tensor) and isinstance(val, torch.Tensor):
                value = value.to(val.dtype)
            adapted.append(value)
        return pytree.tree_unflatten(adapted, spec)

    def adapt_example_inputs(self) -> None:
        """Convert the recorded example inputs to the user inputs' current dtypes."""
        if self.ep.example_inputs is not None:
            self.ep.example_inputs = self.adapt_call(*self.ep.example_inputs)

    def graph_inputs(
        self, args: tuple, kwargs: dict | None = None, *, copy_buffers=False, widen=True
    ) -> list:
        """The graph module's positional inputs for a call with user ``args``/``kwargs``.

        State placeholders get the program's tensors and user placeholders the
        flattened user arguments, so the graph can run directly (much cheaper than
        ``ep.module()``, which unlifts the program first). ``copy_buffers`` hands
        copies of the buffers, so a graph that updates them in place changes no state.
        Pending narrowings are committed first: the graph expects them. A tensor
        ``store_state`` widens is handed widened, or with ``widen=False`` as stored, for
        a ``LeanInterpreter``, which widens it at each read: no fp32 copy of a bf16
        checkpoint is ever whole.
        """
        widened = commit_narrowing(self, self.graph_module.meta)
        user_values = iter(pytree.tree_leaves((tuple(args), dict(kwargs or {}))))
        values = []
        for spec in self.ep.graph_signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                values.append(next(user_values))
                continue
            if spec.kind in _STATE_KINDS:
                tensor = self.state_tensor(spec.target)
            else:
                tensor = self.ep.constants.get(spec.target)
            if spec.target in widened and widen:
                tensor = tensor.to(widened[spec.target])
            elif spec.kind == InputKind.BUFFER and copy_buffers:
                tensor = tensor.clone()
            values.append(tensor)
        return values

    def run(self, args: tuple, kwargs: dict | None = None) -> list:
        """The program's user outputs, flattened, for one call with ``args``/``kwargs``
        (tensors converted to its inputs' dtypes). Runs the graph directly, without
        unlifting or copying the program's parameters; buffers are copied, so that
        in-place updates leave the program's state as it was."""
        with torch.no_grad():
            outputs = self.graph_module(
                *self.graph_inputs(*self.adapt_call(args, kwargs), copy_buffers=True)
            )
        specs = self.ep.graph_signature.output_specs
        return [
            value
            for value, spec in zip(pytree.tree_leaves(outputs), specs)
            if spec.kind == OutputKind.USER_OUTPUT
        ]

    # ---- transactions ----------------------------------------------------------------

    def snapshot(self) -> "Snapshot":
        """Everything a cast changes, saved so that ``Snapshot.restore()`` can put it back."""
        return Snapshot(self)

    def transaction(self, progress: bool | None = False):
        """Run a block that rewrites the program; if it raises, put everything back
        (``fx16.program.transactions.transaction``)."""
        return transaction(self, progress)
