"""What an op's input is computed from: the values a precision rule keeps fp32 with it.

Keeping an op in fp32 helps only if its input arrives with fp32 accuracy. A value
rounded to 16-bit anywhere on its way (an ``x * x`` before a mean, a softmax before
a log) carries that rounding into the op, so a rule marks the op's whole elementwise
past: elementwise ops, reductions, data movement and casts, across the boundaries of
higher-order ops (``fx16.program.boundaries``), up to the placeholders it starts from (a
buffer such as ``inv_freq``, a timestep input: the converters keep them fp32).

The walk stops before a matrix product, convolution or attention: that is the
model's real work, read through an upcast as it was computed in 16-bit, never moved
to fp32 by a rule (a product whose range is proven from state and sizes, such as a
rotary embedding's ``inv_freq @ positions``, is a position computation, and is
walked through).
"""

from collections.abc import Callable

import torch
from torch.fx import Node

from fx16.program.boundaries import Boundaries
from fx16.program.cost import is_product
from fx16.program.nodes import node_val

# The most nodes one op marks upstream (its position or timestep chain, a residual stream).
CHAIN_LIMIT = 256


def elementwise_past(
    seed: Node,
    boundaries: Boundaries,
    proven: Callable[[Node], object | None],
    reads: list[Node] | None = None,
    limit: int = CHAIN_LIMIT,
) -> list[Node]:
    """The float values ``seed`` reads (``reads``: only those) and everything they are
    computed from elementwise, nearest first, at most ``limit``; ``proven(node)`` is
    the node's proven range, or None."""
    found, seen = [], {seed}
    pending = list(boundaries.inputs(seed) if reads is None else reads)
    while pending and len(found) < limit:
        node = pending.pop(0)
        if node in seen:
            continue
        seen.add(node)
        val = node_val(node)
        if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            continue  # integers are exact: a float made from them starts there
        if is_product(node) and proven(node) is None:
            continue  # the model's real work: read as it is computed
        found.append(node)
        pending.extend(boundaries.inputs(node))
    return found
