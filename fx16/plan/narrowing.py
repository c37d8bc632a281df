"""Whether an integer value may be narrowed to int16: the rule both int16 passes apply."""

import torch
from torch.fx import Node

from fx16 import meta
from fx16.analysis.castable_int16 import has_scalar_operand
from fx16.analysis.intervals import Source, value_range
from fx16.choices import INT16_MODES
from fx16.decisions import Reason
from fx16.errors import InvalidOptionError
from fx16.ops.int_ops import WIDE_INT_DTYPES
from fx16.program.casts import before_inserted_casts
from fx16.program.nodes import node_dtype, value_scalars


def check_mode(mode: str) -> str:
    if mode not in INT16_MODES:
        raise InvalidOptionError(f"int16={mode!r} is not one of {', '.join(INT16_MODES)}")
    return mode


def int16_verdict(node: Node, mode: str) -> tuple[Reason, str]:
    """Why ``node`` may (Reason.FITS / ASSUMED_SAFE) or may not compute in int16.

    Reads the findings of the four int16 analyses. The second item gives the
    ranges involved when they decided it.
    """
    if not meta.user_reachable(node):
        return Reason.NOT_USER_REACHABLE, ""
    if meta.flows_into_index(node):
        return Reason.UNSAFE_INDEX, ""
    if has_scalar_operand(node):
        return Reason.SCALAR_OPERAND, ""
    if not meta.castable_int16(node):
        return Reason.NOT_CASTABLE, ""
    if mode == "assume_safe":
        return Reason.ASSUMED_SAFE, ""
    values = {"result": value_range(node)}
    for arg in node.all_input_nodes:
        if node_dtype(arg) in WIDE_INT_DTYPES:
            original = before_inserted_casts(arg)
            values[original.name] = value_range(original)
    for _, scalar in value_scalars(node):
        if isinstance(scalar, int):
            values[str(scalar)] = value_range(scalar)
    detail = ", ".join(f"{name} {found}" for name, found in values.items() if found is not None)
    if mode != "observed":
        values = {
            name: None if found is not None and found.source == Source.OBSERVED else found
            for name, found in values.items()
        }
    if any(found is None for found in values.values()):
        unknown = [name for name, found in values.items() if found is None]
        return Reason.RANGE_UNKNOWN, f"unknown: {', '.join(unknown)}" + (
            f"; {detail}" if detail else ""
        )
    if not all(found.fits(torch.int16) for found in values.values()):
        return Reason.RANGE_EXCEEDS, detail
    return Reason.FITS, detail


def may_narrow(reason: Reason) -> bool:
    return reason in (Reason.FITS, Reason.ASSUMED_SAFE)
