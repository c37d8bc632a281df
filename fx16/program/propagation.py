"""Recompute a node's fake value from (possibly changed) input values."""

import logging
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx import Node
from torch.fx.node import map_arg

from fx16.ops.tables import is_custom_op
from fx16.program.casts import retype_val
from fx16.program.nodes import dtype_arguments, node_val


def propagate_fake(node: Node, args: Any = None, kwargs: Any = None) -> Any:
    """Run ``node``'s op on fake inputs and return the fake result.

    ``args``/``kwargs`` default to the inputs' recorded values. Used where an
    output dtype cannot be derived by rule (multi-output ops, integer promotion);
    it costs a real dispatch, so the passes call it only for such nodes.
    """
    if args is None:
        args = map_arg(node.args, node_val)
    if kwargs is None:
        kwargs = map_arg(node.kwargs, node_val)
    fake_mode = _fake_mode(node)
    if fake_mode is None:
        return node.target(*args, **kwargs)
    with fake_mode:
        return node.target(*args, **kwargs)


def _fake_mode(node: Node):
    """The fake mode of ``node``'s inputs' recorded values (None: they are not fake)."""
    values = map(node_val, node.all_input_nodes)
    return next((val.fake_mode for val in values if hasattr(val, "fake_mode")), None)


# Fake results of ops that make a new tensor, kept on their fake mode under this
# attribute by op and input layout, and by op and input identity (see ``retype_val``:
# nodes with equal metadata may share one value). A fake dispatch costs ~0.5 ms; the
# rewrites make the same few ops on the same shapes in every layer.
_FRESH = "_fx16_fresh_results"


def fresh_result(node: Node) -> Any:
    """``propagate_fake(node)`` for an op whose result is a new tensor, never a view of an
    input: dispatched once per op, input layout (shape, strides, dtype, device) and other
    arguments, and shared by the nodes that ask again.

    A node whose inputs hold the very values an earlier one read (a rewrite's nodes
    read the values this cache gave) is answered by their identity, without describing
    their layouts again."""
    args, kwargs = map_arg(node.args, node_val), map_arg(node.kwargs, node_val)
    fake_mode = _fake_mode(node)
    if fake_mode is None:
        return propagate_fake(node, args, kwargs)
    by_layout, by_identity = _fresh_caches(fake_mode)
    leaves = tuple(_leaves((args, kwargs)))
    identity = _described(node.target, leaves, id)
    known = by_identity.get(identity) if identity is not None else None
    if known is not None and all(a is b for a, b in zip(known[1], leaves)):
        return known[0]
    key = _described(node.target, leaves, _layout)
    if key is None:
        return propagate_fake(node, args, kwargs)
    if key not in by_layout:
        by_layout[key] = propagate_fake(node, args, kwargs)
    if identity is not None:  # the leaves kept with it: no id of theirs is reused
        by_identity[identity] = (by_layout[key], leaves)
    return by_layout[key]


def _fresh_caches(fake_mode) -> tuple[dict, dict]:
    """The fake mode's results by input layout, and by input identity."""
    caches = getattr(fake_mode, _FRESH, None)
    if caches is None:
        caches = ({}, {})
        setattr(fake_mode, _FRESH, caches)
    return caches


def _layout(value: torch.Tensor) -> tuple | None:
    """A tensor's shape, strides, dtype and device (None where a size is symbolic)."""
    shape, stride = tuple(value.shape), value.stride()
    if not all(type(size) is int for size in (*shape, *stride)):
        return None
    return (shape, stride, value.dtype, value.device)


def _described(target: Any, leaves: tuple, tensor_part) -> tuple | None:
    """The op with each of its arguments' leaves described: a tensor by
    ``tensor_part``, any other plain value as it is (None when a leaf has no plain
    description)."""
    described = []
    for value in leaves:
        if isinstance(value, torch.Tensor):
            part = tensor_part(value)
            if part is None:
                return None
        elif value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
            part = (type(value), value)
        else:
            return None
        described.append(part)
    return (target, tuple(described))


def _leaves(value):
    """The leaves of an op's arguments (tuples, lists and dicts of values) in order, each
    keyword's name before its value: what ``pytree.tree_leaves`` gives, and the names, at
    a fraction of its cost (a rewrite describes every node it makes)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _leaves(item)
    else:
        yield value


# (op, input dtypes and other arguments) -> output dtypes, filled by retyped_result.
_OUTPUT_DTYPES: dict[tuple, tuple] = {}
_MOST_REMEMBERED = 4096


def retyped_result(node: Node, args: Any = None, kwargs: Any = None) -> Any:
    """``node``'s recorded value with the dtypes its op gives on the inputs' current dtypes
    (or on the values ``args``/``kwargs``, when given).

    The op is fake-run once per (op, input dtypes, other arguments) and the output
    dtypes remembered: the twelve layer norms of a transformer, or the same model cast
    again, reuse them instead of dispatching again (an LSTM's fake run alone costs
    milliseconds). Shapes come from the recorded value, which already has them.
    """
    if args is None:
        args, kwargs = map_arg(node.args, node_val), map_arg(node.kwargs, node_val)
    key = _signature(node.target, args, kwargs)
    dtypes = _OUTPUT_DTYPES.get(key) if key is not None else None
    if dtypes is None:
        result = propagate_fake(node, args, kwargs)
        if key is not None:
            if len(_OUTPUT_DTYPES) >= _MOST_REMEMBERED:
                _OUTPUT_DTYPES.clear()
            _OUTPUT_DTYPES[key] = tuple(
                leaf.dtype if isinstance(leaf, torch.Tensor) else None
                for leaf in pytree.tree_leaves(result)
            )
        return result
    leaves, spec = pytree.tree_flatten(node_val(node))
    if len(leaves) != len(dtypes):
        return propagate_fake(node, args, kwargs)
    return pytree.tree_unflatten(
        [
            retype_val(leaf, dtype) if isinstance(leaf, torch.Tensor) and dtype else leaf
            for leaf, dtype in zip(leaves, dtypes)
        ],
        spec,
    )


def _signature(target: Any, args: Any, kwargs: Any) -> tuple | None:
    """The op and what decides its output dtypes: input dtypes and the other arguments
    (None when an argument has no plain description)."""
    return _described(target, tuple(_leaves((args, kwargs))), _dtype_of)


def _dtype_of(value: torch.Tensor) -> torch.dtype:
    return value.dtype


def _concrete(size) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _real_like(value: Any) -> Any:
    """A small real tensor with the dtype and (hinted) shape of a fake one."""
    if isinstance(value, torch.Tensor):
        shape = [_concrete(size) for size in value.shape]
        return torch.ones(shape, dtype=value.dtype, device="cpu")
    return value


def output_dtypes_by_running(node: Node, fake_result: Any, args: Any, kwargs: Any) -> Any:
    """``fake_result`` with the dtypes a real run of the op on (fake) ``args`` and
    ``kwargs`` gives.

    Some CPU kernels disagree with their meta functions when inputs mix float dtypes
    (layer_norm of a bf16 input with fp32 weights returns fp32 on the CPU, bf16 in
    fake mode); running the op once on small real tensors settles it.
    """
    args, kwargs = pytree.tree_map(_real_like, (args, kwargs))
    with torch.no_grad():
        real = node.target(*args, **kwargs)
    if isinstance(fake_result, torch.Tensor):
        return retype_val(fake_result, real.dtype)
    if isinstance(fake_result, (list, tuple)):
        return type(fake_result)(
            retype_val(f, r.dtype) if isinstance(f, torch.Tensor) else f
            for f, r in zip(fake_result, real)
        )
    return fake_result


def narrowed_result(
    node: Node, low: torch.dtype, produces_fp32: bool, args: Any = None, kwargs: Any = None
) -> Any:
    """The value ``node`` computes now that its inputs are ``low`` (``args``/``kwargs``:
    the input values it will run on, when they are not the recorded ones).

    A single fp32 tensor result of an ATen op becomes ``low`` (ATen's float ops follow
    their inputs); other results that held fp32 are recomputed per output. A custom op
    is always asked through its fake kernel: it may compute any dtype (a dequantize
    returns its scale's dtype, whatever its ``output_dtype`` argument says).
    """
    if is_custom_op(node.target):  # its result may depend on more than dtypes: no cache
        return propagate_fake(node, args, kwargs)
    val = node_val(node)
    if isinstance(val, torch.Tensor) and val.dtype == torch.float32:
        return retype_val(val, low)
    return retyped_result(node, args, kwargs) if produces_fp32 else val


def runs_narrowed(node: Node, low: torch.dtype) -> bool:
    """The op's fake kernel accepts the node's fp32 tensors and fp32 dtype arguments in
    ``low``: the state ``run_in_low`` would leave it in. False when the kernel raises, or
    the op has none (a custom op registered without a fake or meta kernel)."""

    def narrowed(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
            return retype_val(value, low)
        return low if value is torch.float32 else value

    args, kwargs = pytree.tree_map(narrowed, map_arg((node.args, dict(node.kwargs)), node_val))
    kwargs = dict(kwargs)
    for (kind, name), dtype in dtype_arguments(node):
        if kind == "kwargs" and dtype is torch.float32:
            kwargs[name] = low  # a custom op's float32 default follows too
    # FakeTensorMode logs a kernel's exception as an error before raising it; here a
    # refusal is an answer, not an error.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        propagate_fake(node, args, kwargs)
    except Exception:  # whatever the kernel raises, it cannot run narrowed
        return False
    finally:
        fake_log.setLevel(level)
    return True
