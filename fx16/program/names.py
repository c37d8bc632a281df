"""The names a user gives fx16 for parts of a program, and the check that each names something.

A policy's ``modules`` and ``nodes``, ``keep_io_types`` and ``force_fp32`` refer to
the program by name. A name that matches nothing would be ignored, and the cast would
silently differ from what was asked, so ``check_names`` refuses it with an
``InvalidOptionError`` that lists the names there are (or the closest ones).

Outputs are addressed as the model returns them, not by the FX names the cast
changes: by position among the user outputs (``0``, or ``"0"``) and by the model's
own name (``"logits"``; a nested output as ``"1.a"``, a key path joined by dots).
Inputs are addressed by their placeholder names (the forward's argument names).
"""

import difflib
from collections.abc import Iterable

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import OutputKind
from torch.fx import GraphModule, Node

from fx16.errors import InvalidOptionError
from fx16.program import Program
from fx16.program.nodes import node_module_path

NOTHING = "{} names nothing in this program"
# How many names an error lists before it says how many more there are.
_LISTED = 12


def output_names(program: Program) -> list[str]:
    """The model's own name of each user output, in order: the key path of its leaf
    in the output structure ("logits", "1.a"), or its position where the structure
    is not known."""
    specs = [s for s in program.ep.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    out_spec = program.ep.call_spec.out_spec
    if out_spec is None or out_spec.num_leaves != len(specs):
        return [str(index) for index in range(len(specs))]
    tree = pytree.tree_unflatten(list(range(len(specs))), out_spec)
    paths = [path for path, _ in pytree.tree_flatten_with_path(tree)[0]]
    return [".".join(_key_name(key) for key in path) or str(i) for i, path in enumerate(paths)]


def _key_name(key) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def user_output_positions(program: Program) -> list[int]:
    """The position of each user output in the graph's output node (mutated buffers
    come first there)."""
    specs = program.ep.graph_signature.output_specs
    return [index for index, spec in enumerate(specs) if spec.kind == OutputKind.USER_OUTPUT]


def kept_output_positions(program: Program, entries: Iterable) -> set[int]:
    """The graph output positions that ``entries`` (keep_io_types) name."""
    addresses = _output_addresses(program)
    return {addresses[str(entry)] for entry in entries if str(entry) in addresses}


def _output_addresses(program: Program) -> dict[str, int]:
    """Every name a user output answers to - its position, the model's name for it,
    the node the graph returns now - with its position in the graph's output node."""
    positions = user_output_positions(program)
    returned = program.output_node().args[0]
    addresses = {name: positions[i] for i, name in enumerate(output_names(program))}
    addresses |= {str(i): position for i, position in enumerate(positions)}
    return addresses | {v.name: p for p in positions if isinstance(v := returned[p], Node)}


def check_names(program: Program, policy, force_fp32: Iterable[str] = ()) -> None:
    """``InvalidOptionError`` for any name in ``policy`` (its ``keep_io_types``,
    ``modules`` and ``nodes``) or in ``force_fp32`` that names nothing in ``program``,
    or an ``ops`` entry that is no ATen op."""
    if not isinstance(policy.keep_io_types, bool):
        inputs = [p.name for p in program.user_input_placeholders()]
        valid = {*inputs, *_output_addresses(program)}
        _refuse(
            NOTHING.format("keep_io_types"),
            [e for e in policy.keep_io_types if str(e) not in valid],
            [*inputs, *(" or ".join(names) for names in _output_labels(program))],
            "inputs and outputs (an output by position or by the model's name)",
        )
    graph_modules = [m for m in program.graph_module.modules() if isinstance(m, GraphModule)]
    if policy.nodes or force_fp32:
        nodes = {n.name for m in graph_modules for n in m.graph.nodes}
        for option, names in (("policy nodes", policy.nodes), ("force_fp32", force_fp32)):
            _refuse(NOTHING.format(option), [n for n in names if n not in nodes], nodes, "nodes")
    if policy.modules:
        paths = _module_paths(program, graph_modules)
        _refuse(
            NOTHING.format("policy modules"),
            [p for p in policy.modules if p not in paths],
            paths,
            "modules",
        )
    _refuse(
        "policy ops names no ATen op",
        [op for op in policy.ops if not _is_aten_op(op)],
        [],
        "ATen op names, as in torch.ops.aten (softmax, linear, ...), or an overload of one "
        "(softmax.int)",
    )


def _is_aten_op(name: str) -> bool:
    """``name`` is an ATen op packet ("softmax") or one of its overloads ("softmax.int",
    as ``fx16 inspect`` prints ops)."""
    packet_name, _, overload = str(name).partition(".")
    packet = getattr(torch.ops.aten, packet_name, None)
    return packet is not None and (not overload or overload in packet.overloads())


def _output_labels(program: Program) -> list[tuple[str, ...]]:
    """Each user output's names: its position, and the model's name where it has one."""
    return [
        (str(index), name) if name != str(index) else (name,)
        for index, name in enumerate(output_names(program))
    ]


def _module_paths(program: Program, graph_modules: list[GraphModule]) -> list[str]:
    """Every module path the program's nodes and parameters belong to, with each prefix."""
    owners = {slot.target.rpartition(".")[0] for slot in program.state_slots()}
    owners |= {node_module_path(n) or "" for m in graph_modules for n in m.graph.nodes}
    prefixes = set()
    for path in filter(None, owners):
        parts = path.split(".")
        prefixes.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    return sorted(prefixes)


def _refuse(problem: str, unknown: list, valid: Iterable[str], kind: str) -> None:
    if not unknown:
        return
    valid = sorted(set(valid), key=lambda name: (len(name), name))
    close = sorted(
        {match for name in unknown for match in difflib.get_close_matches(str(name), valid, 3)}
    )
    if close:
        hint = f"closest: {', '.join(close)}"
    elif valid:
        more = f" and {len(valid) - _LISTED} more" if len(valid) > _LISTED else ""
        hint = f"{kind}: {', '.join(valid[:_LISTED])}{more}"
    else:
        hint = f"use {kind}"
    raise InvalidOptionError(f"{problem}: {', '.join(map(repr, unknown))}; {hint}")
