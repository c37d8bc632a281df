"""The model's own fp32 regions after decomposition, for the fp16 cast inserter.

After ``run_decompositions`` a model's ``x.float()`` on a value that was fp32 at
export (a no-op cast) is gone; only its ``_assert_tensor_metadata(dtype=float32)``
check remains. The planner (``fx16.plan.planner.Planner.assertion``) reads the region from
such checks and plans the cast the model's own would have been where fx16's
decisions make it matter; ``visit_assert`` puts it back, and keeps every check's
dtype equal to the value it checks.

Reads: the check's step in the plan. Writes: the cast and its decision, the readers'
inputs, the checks' dtype arguments.
"""

import torch
from torch.fx import Node

from fx16.decisions import PRECISION
from fx16.plan.steps import Step
from fx16.program.casts import WHY_CAST_BACK, WHY_UPCAST
from fx16.program.nodes import node_dtype, set_argument

FP32 = torch.float32


def visit_assert(run, node: Node, step: Step | None) -> None:
    """``_assert_tensor_metadata`` checks the dtype of the value as it is now; the
    cast the plan puts back after it (``step.restored``) goes in first."""
    if step is not None and step.restored is not None:
        _restore_explicit_cast(run, node, step.restored)
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


def _restore_explicit_cast(run, assertion: Node, restored: tuple) -> None:
    """Put back, after ``assertion``, the model's fp32 cast that decomposition dropped:
    the cast opening the region (its island's ops read it) or the way back from one
    (every consumer after the assertion reads it)."""
    dtype, decision, readers = restored
    value = assertion.args[0]
    why = WHY_UPCAST if dtype == FP32 else WHY_CAST_BACK
    cast = run.casts.cast_placed_after(assertion, value, dtype, why)
    for user in readers:
        user.replace_input_with(value, cast)
    cast.meta[PRECISION] = decision
    run.modified = True
