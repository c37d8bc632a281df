"""Recompute a node's fake value from (possibly changed) input values."""

from typing import Any

from torch.fx import Node
from torch.fx.node import map_arg

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
