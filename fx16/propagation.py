"""Recompute a node's fake value from (possibly changed) input values."""

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx import Node
from torch.fx.node import map_arg

from fx16.casts import retype_val
from fx16.nodes import node_val


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
    fake_mode = next(
        (val.fake_mode for val in map(node_val, node.all_input_nodes) if hasattr(val, "fake_mode")),
        None,
    )
    if fake_mode is None:
        return node.target(*args, **kwargs)
    with fake_mode:
        return node.target(*args, **kwargs)


# (op, input dtypes and other arguments) -> output dtypes, filled by retyped_result.
_OUTPUT_DTYPES: dict[tuple, tuple] = {}
_MOST_REMEMBERED = 4096


def retyped_result(node: Node) -> Any:
    """``node``'s recorded value with the dtypes its op gives on the inputs' current dtypes.

    The op is fake-run once per (op, input dtypes, other arguments) and the output
    dtypes remembered: the twelve layer norms of a transformer, or the same model cast
    again, reuse them instead of dispatching again (an LSTM's fake run alone costs
    milliseconds). Shapes come from the recorded value, which already has them.
    """
    key = _signature(node)
    dtypes = _OUTPUT_DTYPES.get(key) if key is not None else None
    if dtypes is None:
        result = propagate_fake(node)
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
        return propagate_fake(node)
    return pytree.tree_unflatten(
        [
            retype_val(leaf, dtype) if isinstance(leaf, torch.Tensor) and dtype else leaf
            for leaf, dtype in zip(leaves, dtypes)
        ],
        spec,
    )


def _signature(node: Node) -> tuple | None:
    """The op and what decides its output dtypes: input dtypes and the other arguments
    (None when an argument has no plain description)."""
    described = []
    for leaf in pytree.tree_leaves((node.args, node.kwargs)):
        value = node_val(leaf) if isinstance(leaf, Node) else leaf
        if isinstance(value, torch.Tensor):
            described.append(value.dtype)
        elif value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
            described.append((type(value), value))
        else:
            return None
    return (node.target, tuple(described))


def _concrete(size) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _real_like(value: Any) -> Any:
    """A small real tensor with the dtype and (hinted) shape of a fake one."""
    if isinstance(value, torch.Tensor):
        shape = [_concrete(size) for size in value.shape]
        return torch.ones(shape, dtype=value.dtype, device="cpu")
    return value


def output_dtypes_by_running(node: Node, fake_result: Any) -> Any:
    """``fake_result`` with the dtypes a real run of the op gives.

    Some CPU kernels disagree with their meta functions when inputs mix float dtypes
    (layer_norm of a bf16 input with fp32 weights returns fp32 on the CPU, bf16 in
    fake mode); running the op once on small real tensors settles it.
    """
    args = map_arg(node.args, lambda arg: _real_like(node_val(arg)))
    kwargs = map_arg(node.kwargs, lambda arg: _real_like(node_val(arg)))
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
