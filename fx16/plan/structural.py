"""Planning the nodes no precedence list decides: an element of a multi-output op, an
in-place op, a dtype check left by decomposition.

Each function takes the planner of the graph (``fx16.plan.planner.Planner``) and the node,
and returns its ``Step`` (None: nothing to change). Reads and writes as the planner
does: nothing on the graph.
"""

import torch
from torch.fx import Node

from fx16 import meta
from fx16.analysis.explicit_fp32 import island_readers
from fx16.analysis.islands import asserted_dtype
from fx16.decisions import Reason, decision, decision_of
from fx16.plan.steps import Read, Step
from fx16.program.casts import is_cast, retype_val
from fx16.program.nodes import FLOAT_DTYPES, mutated_argument, node_dtype, node_val

FP32 = torch.float32


def plan_getitem(planner, node: Node) -> Step | None:
    """An element of a multi-output op: its value and decision."""
    container, index = node.args
    read = planner.plan.read(container, node)
    if not isinstance(read.val, (list, tuple)):
        return None
    element = read.val[index]
    if not isinstance(element, torch.Tensor):
        return None
    if read.decision is None:
        return Step(None, None, element)
    dtype = element.dtype if element.dtype in FLOAT_DTYPES else read.decision.dtype
    step = Step(None, decision(dtype, read.decision.reason, read.decision.detail), element)
    if node_dtype(node) == FP32 and element.dtype == FP32:
        if step.decision.reason != Reason.EXPLICIT_FP32:
            planner.cast_back(node, step, step.decision.reason)
    return step


def plan_in_place(planner, node: Node) -> Step | None:
    """An in-place op keeps the dtype of the tensor it writes to, and its decision:
    consumers of a cache written in place read it as the 16-bit tensor it now is."""
    written = planner.plan.read(mutated_argument(node), node)
    val = node_val(node)
    if isinstance(val, torch.Tensor) and written.dtype is not None:
        val = retype_val(val, written.dtype)
    inherited = written.decision if written.narrowed else None
    if inherited is None and val is node_val(node):
        return None
    return Step(None, inherited, val)


def plan_assertion(planner, node: Node) -> Step | None:
    """A dtype check of a value (``_assert_tensor_metadata``) after decomposition. An
    assertion of fp32 with no cast after it marks the model's fp32 region, as the
    cast would have: the plan puts that cast back when fx16's decisions make it
    matter - it opens an fp32 region of a 16-bit value that ExplicitFp32Analysis
    keeps, or is the way back from one. The ops of the island read the opening
    cast; every consumer after the assertion reads the way back."""
    value = node.args[0] if node.args else None
    if asserted_dtype(node) != FP32 or not isinstance(value, Node):
        return None
    read = planner.plan.read(value, node)
    verdict = meta.island_verdict(node)
    opens = read.dtype == planner.low and meta.keeps_island(node)
    closes = read.dtype == FP32 and read.island and planner.policy.cast_back
    after = planner.positions[node]
    later = [user for user in value.users if planner.positions.get(user, -1) > after]
    if not (opens or closes) or not later or any(is_cast(user) for user in later):
        return None  # nothing to do, or the cast is still there
    if any(decision_of(user) is not None for user in later):
        return None  # decided on an earlier run: casting twice equals casting once
    if opens:
        opening = decision(FP32, Reason.EXPLICIT_FP32, verdict.why)
        cast = Read(retype_val(read.val, FP32), opening, value.name)
    else:
        cast = Read(
            retype_val(read.val, planner.low), decision(planner.low, Reason.FITS), value.name
        )
        cast.source = read
    readers = island_readers(node, later) if opens else later
    for reader in readers:
        planner.plan.redirects[(reader, value)] = cast
    return Step(None, None, None, restored=(cast.dtype, cast.decision, tuple(readers)))
