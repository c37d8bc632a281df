"""What an op computes from its inputs as the plan leaves them: the values it runs on in
16-bit, and the result of an op that follows its inputs' dtypes.

Functions of the planner (``fx16.plan.planner.Planner``) and a node; they read the plan
and the node, run the op on fake values where a dtype cannot be derived by rule, and
change nothing.
"""

import math

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from fx16.decisions import Reason, decision
from fx16.ops.numeric_tables import GUARD_ARGUMENTS
from fx16.ops.numerics import (
    largest,
    round_scalar_to_fp16,
    scalar_for_16_bit_op,
    smallest_subnormal,
)
from fx16.plan.precedence import Action, Choice
from fx16.plan.steps import Read, Step
from fx16.program.casts import retype_val
from fx16.program.nodes import FLOAT_DTYPES, float_rank, tensor_inputs, tensor_leaves, value_scalars
from fx16.program.propagation import output_dtypes_by_running, propagate_fake

FP32 = torch.float32


def narrowed_arguments(planner, node: Node, narrowed: tuple, arguments: list) -> tuple:
    """The arguments ``node`` runs on in 16-bit, as values: its inputs as read (the
    ``narrowed`` ones in 16-bit), with ``arguments`` written."""

    def value(arg: Node):
        read = planner.plan.read(arg, node)
        return retype_val(read.val, planner.low) if arg in narrowed else read.val

    args, kwargs = list(map_arg(node.args, value)), dict(map_arg(node.kwargs, value))
    for (kind, key), new in arguments:
        if kind == "args":
            args[key] = new
        else:
            kwargs[key] = new
    return tuple(args), kwargs


def follow(
    planner, node: Node, choice: Choice, promote: bool, widest: torch.dtype | None = None
) -> Step:
    """Computed in the dtype its inputs give it (``promote``: their widest first;
    ``widest``: float inputs narrower than it widened to it first)."""
    reads = {arg: planner.plan.read(arg, node) for arg in tensor_inputs(node)}
    if promote:
        floats = [read.dtype for read in reads.values() if read.dtype in FLOAT_DTYPES]
        widest = max(floats, key=float_rank, default=None)
    if widest is not None:
        reads = {
            arg: Read(retype_val(read.val, widest), None, arg.name)
            if read.dtype in FLOAT_DTYPES and float_rank(read.dtype) < float_rank(widest)
            else read
            for arg, read in reads.items()
        }
    input_dtypes = {read.dtype for read in reads.values() if read.dtype in FLOAT_DTYPES}

    def value(arg: Node):
        return reads[arg].val if arg in reads else planner.plan.read(arg, node).val

    args, kwargs = map_arg(node.args, value), map_arg(node.kwargs, value)
    try:
        result = propagate_fake(node, args, kwargs)
        if len(input_dtypes) > 1:  # mixed float inputs: trust a real kernel, not the meta one
            result = output_dtypes_by_running(node, result, args, kwargs)
    except RuntimeError:
        if promote or len(input_dtypes) < 2:
            raise
        # the op cannot mix float dtypes (a convolution with bf16 input, fp32 weight):
        # it runs in the widest of them
        return follow(planner, node, choice, promote=True)
    dtypes = {leaf.dtype for leaf in tensor_leaves(result) if leaf.is_floating_point()}
    scalar_overflow = any(
        round_scalar_to_fp16(float(v), planner.low) is None for _, v in value_scalars(node)
    )
    if planner.low in dtypes and scalar_overflow:  # safety first: the scalar needs fp32
        fp32 = Choice(Action.FP32, Reason.SCALAR_OVERFLOW, cast_back=planner.policy.cast_back)
        step = planner.in_fp32(node, fp32, True)
    else:
        dtype = planner.low if planner.low in dtypes else FP32
        step = Step(choice, decision(dtype, choice.reason, choice.detail), result)
        if dtype == planner.low:
            step.arguments = saturated_sentinels(node, planner.low)
    step.widest = widest
    return step


def scalar_arguments(view, low: torch.dtype, guard) -> tuple[list, list]:
    """The float scalars of ``view``'s node as an op computing in ``low`` takes them
    (``scalar_for_16_bit_op``: kept as eager applies them, a sentinel saturated, one
    below the smallest subnormal clamped to it where the op adds it as a guard:
    ``guard(location, value)``), as ``(location, new)`` for those that change; and
    ``(old, new)`` for the clamped ones."""
    arguments, clamped = [], []
    for location, value in view.scalars:
        if not isinstance(value, float):
            continue
        new = scalar_for_16_bit_op(value, low, guard(location, value))
        if new != value:
            arguments.append((location, new))
            if value and abs(value) < smallest_subnormal(low):
                clamped.append((value, new))
    return arguments, clamped


def saturated_sentinels(node: Node, low: torch.dtype) -> tuple:
    """The finite float scalars of ``node`` beyond ``low``'s range - infinity-like
    sentinels such as ``finfo(float32).min`` - as the +-maximum they stand for: an op
    computing in 16-bit cannot take them (``clamp`` of a bf16 tensor to
    -3.4028e38 raises). Others beyond it keep the op in fp32 (``scalar_overflow``)."""
    top = largest(low)
    return tuple(
        (location, round_scalar_to_fp16(value, low))
        for location, value in value_scalars(node)
        if isinstance(value, float) and top < abs(value) < math.inf
    )


def guards(target, location, value: float) -> bool:
    """Whether the scalar ``value`` at ``location`` (``("args", i)`` or ``("kwargs",
    name)``) of an op calling ``target`` keeps its result away from zero
    (``GUARD_ARGUMENTS``: an eps added, a clamp's positive minimum)."""
    where = GUARD_ARGUMENTS.get(target)
    if where is None:
        return False
    position, name, sign = where
    return location in (("args", position), ("kwargs", name)) and value * sign > 0
