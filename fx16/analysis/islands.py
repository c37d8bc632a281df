"""The model's own fp32 regions: where a model casts to fp32 itself, and why it matters.

A model that computes in fp32 writes ``x.float()`` before a variance, a softmax or
a rotary embedding. Once the model is cast, such a cast opens an fp32 island in a
16-bit program. ``island_region`` finds the ops the island would hold (those fed
only by it, up to the model's next cast); ExplicitFp32Analysis decides from them
whether the island stays, and InsertFP16CastsPass's decisions mark the kept
island's nodes (reason ``EXPLICIT_FP32``). After ``run_decompositions`` only the cast's
``_assert_tensor_metadata`` check may be left (``asserted_dtype``).
"""

from collections.abc import Iterable

import torch
from torch.fx import Node

from fx16 import meta
from fx16.decisions import Decision, Reason, decision
from fx16.ops.kinds import PRECISION_SENSITIVE_OPS, op_name
from fx16.program.boundaries import Boundaries
from fx16.program.casts import is_cast
from fx16.program.nodes import FLOAT_DTYPES, node_dtype, tensor_inputs

FP32 = torch.float32

# How many ops after a model's fp32 cast an island may hold.
_REGION_LOOKAHEAD = 32


def island_decision(node: Node, dtype: torch.dtype) -> Decision:
    """``dtype`` for ``node`` with the reason its island verdict gives: inside a kept
    region, or the model's fp32 cast made 16-bit, and the evidence; an ordinary fit for
    a node that opens no region."""
    verdict = meta.island_verdict(node)
    if verdict is None:
        return decision(dtype, Reason.FITS)
    kept = verdict.keep and dtype == FP32
    reason = Reason.EXPLICIT_FP32 if kept else Reason.EXPLICIT_FP32_RETARGETED
    return decision(dtype, reason, verdict.why)


def island_region(
    start: Iterable[Node], readers: Iterable[Node], boundaries: Boundaries | None = None
) -> list[Node]:
    """The ops an fp32 region holds: ``readers`` (the first ops reading the region's
    ``start`` values) and, after them, every op whose float inputs all come from
    the region, up to the next cast (in the source, the cast back to the input
    dtype) and at most ``_REGION_LOOKAHEAD`` ops. GPT-2's
    ``attn_weights.type(value.dtype)`` - fp32 only because the model was fp32 at
    export - holds a dropout, and its matmul mixes in values from outside.

    With ``boundaries`` the region follows its values into the bodies of
    higher-order ops (a variance computed under ``torch.no_grad()``) and out of them
    through their results; the ops it holds there are in the list too."""
    inside, held, frontier = set(start), [], list(readers)
    while frontier and len(held) < _REGION_LOOKAHEAD:
        node = frontier.pop(0)
        if boundaries is not None and (node in boundaries.looked_into or node.op == "output"):
            entered = _crossed(node, inside, boundaries)
            inside.update(entered)
            frontier.extend(user for value in entered for user in value.users)
            continue
        if node in inside or node.op != "call_function" or is_cast(node):
            continue
        floats = [a for a in tensor_inputs(node) if node_dtype(a) in FLOAT_DTYPES]
        if not all(arg in inside for arg in floats):
            continue  # it mixes in values from outside: the region ends there
        inside.add(node)
        held.append(node)
        frontier.extend(node.users)
    return held


def _crossed(node: Node, inside: set[Node], boundaries: Boundaries) -> list[Node]:
    """Where the region's values become other nodes across a boundary: the body
    placeholders a higher-order op feeds them to, or the results a body's output
    node returns them as."""
    values = [arg for arg in node.all_input_nodes if arg in inside]
    return [sink for value in values for sink in boundaries.crossing_sinks(value)]


def is_sensitive(node: Node) -> bool:
    """An op whose accuracy is why models compute it in fp32: a reduction, softmax,
    exp, pow, rsqrt, sin/cos."""
    return op_name(node) in PRECISION_SENSITIVE_OPS


def asserted_dtype(assertion: Node) -> torch.dtype | None:
    """The dtype an ``_assert_tensor_metadata`` node checks for, if it checks one."""
    if len(assertion.args) > 3 and isinstance(assertion.args[3], torch.dtype):
        return assertion.args[3]
    dtype = assertion.kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) else None
