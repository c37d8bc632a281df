"""Which values only ever reach matrix products, convolutions and attention as operands.

A state tensor converted to 16-bit may hold nonzero elements below the smallest
subnormal. Where a reader can tell zero from nonzero (a division, a log, a comparison, a
mask) the conversion lifts them to +-the smallest subnormal instead of flushing them;
finding them costs as much as the conversion itself. An operand of a product (the ops of
kind ``OpKind.COMPUTE``: matrix products, convolutions, attention) cannot tell: each
element is a factor or an addend of sums of products, whose result moves by at most the
element's change times what it multiplies, so the nearest 16-bit value, which a flush is
for an element below half the smallest subnormal, is also the one that bounds the change
least (a lift would move the element up to twice as far). That holds for every input,
whatever the element's neighbours and whatever the product is given.

Reads: the graph's users and, across higher-order ops' boundaries, the ``Boundaries``
of the program (``Facts.of(root).boundaries``). Writes: nothing.
"""

import operator

from torch.fx import Node

from fx16.ops.kinds import OpKind, target_kind
from fx16.ops.tables import ASSERT_METADATA_OPS, CAST_OPS, VALUE_PRESERVING_OPS, per_op
from fx16.program.boundaries import Boundaries
from fx16.program.nodes import mutated_argument


def only_product_operands(node: Node, boundaries: Boundaries) -> bool:
    """Whether every reader of ``node``'s value is a matrix product, convolution or
    attention (``OpKind.COMPUTE``) or a check of its metadata, directly or through ops that only
    move values (views, slices, concatenation, ``getitem``, a cast to another float
    dtype), into and out of the bodies of higher-order ops fx16 looks into. False when
    the value (or a view of it) is read by any other op, written in place, or returned
    by the program; True for a value nothing reads."""
    readers = computing_readers(node, boundaries)
    return readers is not None and all(_is_product(reader.target) for reader in readers)


def computing_readers(node: Node, boundaries: Boundaries) -> list[Node] | None:
    """The ops that compute from ``node``'s value, reached directly or through ops that
    only move values (``_moves_values``), into and out of the bodies of higher-order
    ops fx16 looks into; metadata checks, which read no values, left out. None where
    the value escapes that walk: returned by the program, written in place, or read by
    something that is not an op call."""
    top = boundaries.graph_modules[0].graph
    seen, pending, found = set(), [node], []
    while pending:
        value = pending.pop()
        if value in seen:
            continue
        seen.add(value)
        pending.extend(boundaries.crossing_sinks(value))  # the same value, in another graph
        for reader in value.users:
            if reader in boundaries.looked_into:
                continue  # its bodies' placeholders and its results are the crossing sinks
            if reader.op == "output":
                if reader.graph is top:
                    return None
                continue  # a body's output: its readers are the op's results (crossing sinks)
            if reader.op != "call_function" or mutated_argument(reader) is not None:
                return None
            if _reads_no_values(reader.target):
                continue
            if _moves_values(reader):
                pending.append(reader)
            else:
                found.append(reader)
    return found


@per_op
def _is_product(target) -> bool:
    return target_kind(target) == OpKind.COMPUTE


@per_op
def _reads_no_values(target) -> bool:
    """A check of dtype, device and shape (export's ``_assert_tensor_metadata``)."""
    return target in ASSERT_METADATA_OPS


def _moves_values(reader: Node) -> bool:
    """``reader``'s result holds values of its operands and nothing computed from them:
    data movement (not a write: ``copy_`` stores into its first argument), ``getitem``
    of a split, or a cast whose result is a float."""
    if reader.target is operator.getitem:
        return True
    if reader.target in CAST_OPS:
        val = reader.meta.get("val")
        return getattr(val, "dtype", None) is not None and val.dtype.is_floating_point
    return reader.target in VALUE_PRESERVING_OPS
