"""The model's own fp32 regions: where a model casts to fp32 itself, and why it matters.

A model that computes in fp32 writes ``x.float()`` before a variance, a softmax or
a rotary embedding. Once the model is cast, such a cast opens an fp32 island in a
16-bit program; InsertFP16CastsPass keeps the island when an op whose accuracy
needs fp32 follows (``opens_sensitive_region``), and its decisions mark the
island's nodes (``is_island``). After ``run_decompositions`` only the cast's
``_assert_tensor_metadata`` check may be left (``asserted_dtype``).
"""

import torch
from torch.fx import Node

from fx16.casts import is_cast
from fx16.decisions import Reason, decision_of
from fx16.nodes import FLOAT_DTYPES, node_dtype, tensor_inputs
from fx16.ops import PRECISION_SENSITIVE_OPS

# How far to look after a model's fp32 cast for a precision-sensitive op.
_REGION_LOOKAHEAD = 32


def is_island(node: Node) -> bool:
    """``node`` was kept fp32 as part of a region the model asks for explicitly."""
    decision = decision_of(node)
    return decision is not None and decision.reason == Reason.EXPLICIT_FP32


def opens_sensitive_region(cast: Node) -> bool:
    """The model's ``x.to(torch.float32)`` leads, before its next cast, to an op whose
    accuracy needs fp32 (a variance, softmax, exp, rotary sin/cos). GPT-2's
    ``attn_weights.type(value.dtype)`` - fp32 only because the model was fp32 at export -
    leads to dropout and then a matmul with 16-bit values, and is not kept. The region
    is what the inserter would keep in fp32: ops fed only by it."""
    region, frontier = {cast}, list(cast.users)
    while frontier and len(region) < _REGION_LOOKAHEAD:
        node = frontier.pop(0)
        if node in region or node.op != "call_function" or is_cast(node):
            continue
        floats = [a for a in tensor_inputs(node) if node_dtype(a) in FLOAT_DTYPES]
        if not all(arg in region for arg in floats):
            continue  # it mixes in values from outside: the region ends there
        if getattr(node.target, "_opname", None) in PRECISION_SENSITIVE_OPS:
            return True
        region.add(node)
        frontier.extend(node.users)
    return False


def asserted_dtype(assertion: Node) -> torch.dtype | None:
    """The dtype an ``_assert_tensor_metadata`` node checks for, if it checks one."""
    if len(assertion.args) > 3 and isinstance(assertion.args[3], torch.dtype):
        return assertion.args[3]
    dtype = assertion.kwargs.get("dtype")
    return dtype if isinstance(dtype, torch.dtype) else None
