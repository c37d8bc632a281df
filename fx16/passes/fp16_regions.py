"""The model's own fp32 regions after decomposition, for the fp16 cast inserter.

After ``run_decompositions`` a model's ``x.float()`` on a value that was fp32 at
export (a no-op cast) is gone; only its ``_assert_tensor_metadata(dtype=float32)``
check remains. These functions read the region from such checks, put back the
cast the model's own would have been where fx16's decisions make it matter, and
keep every check's dtype equal to the value it checks.

Reads: ``meta["fx16.explicit_fp32"]`` (the island verdicts), the decisions made so
far. Writes: inserted casts and their decisions, the checks' dtype arguments.
"""

import torch
from torch.fx import Node

from fx16 import meta
from fx16.analysis.explicit_fp32 import island_readers
from fx16.casts import WHY_CAST_BACK, WHY_UPCAST, is_cast
from fx16.decisions import Reason, decide, decision_of
from fx16.islands import asserted_dtype, is_island
from fx16.nodes import node_dtype, set_argument

FP32 = torch.float32


def visit_assert(run, node: Node) -> None:
    """``_assert_tensor_metadata`` checks the dtype of the value as it is now. An
    assertion of fp32 with no cast after it marks the model's fp32 region, as the
    cast would have."""
    if asserted_dtype(node) == FP32 and isinstance(node.args[0], Node):
        restore_explicit_cast(run, node)
    dtype = node_dtype(node.args[0])
    if dtype is None:
        return
    if len(node.args) > 3 and isinstance(node.args[3], torch.dtype):
        if node.args[3] != dtype:
            set_argument(node, ("args", 3), dtype)
            run.modified = True
        # torch.export.load may also leave a copy in kwargs; two dtypes break the call.
        if "dtype" in node.kwargs:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
    elif isinstance(node.kwargs.get("dtype"), torch.dtype) and node.kwargs["dtype"] != dtype:
        set_argument(node, ("kwargs", "dtype"), dtype)
        run.modified = True


def restore_explicit_cast(run, assertion: Node) -> None:
    """Put back, after ``assertion``, the model's fp32 cast that decomposition dropped,
    when fx16's decisions make it matter: it opens an fp32 region of a 16-bit value
    that ExplicitFp32Analysis keeps, or (``is_island``) is the way back from one. The
    ops of the island read the opening cast; every consumer after the assertion reads
    the way back."""
    value = assertion.args[0]
    dtype = node_dtype(value)
    verdict = meta.island_verdict(assertion)
    opens = dtype == run.low and verdict is not None and verdict.keep
    closes = dtype == FP32 and is_island(value) and run.policy.cast_back
    later = run.later_users(value, assertion)
    if not (opens or closes) or not later or any(is_cast(user) for user in later):
        return  # nothing to do, or the cast is still there (not decomposed, or cast before)
    if any(decision_of(user) is not None for user in later):
        return  # decided on an earlier run: casting twice equals casting once
    cast = run.casts.cast_placed_after(
        assertion,
        value,
        FP32 if opens else run.low,
        WHY_UPCAST if opens else WHY_CAST_BACK,
    )
    for user in island_readers(assertion, later) if opens else later:
        user.replace_input_with(value, cast)
    if opens:
        decide(cast, FP32, Reason.EXPLICIT_FP32, detail=verdict.why)
    else:
        decide(cast, run.low, Reason.FITS)
    run.modified = True
