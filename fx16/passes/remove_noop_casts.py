"""RemoveNoopCastsPass: drop casts whose input already has the target dtype."""

from torch.fx import Node

from fx16.passes.cast_rule import ReplaceBySource, same_dtype_cast


class RemoveNoopCastsPass(ReplaceBySource):
    """``to(x, d)`` with x already of dtype d is replaced by x.

    Input graph:  x:f16 -> _to_copy(f16) -> y
    Output graph: x:f16 -> y

    Refuses when a write in place reaches the result or x, through any view of either
    (the copy keeps them apart), or when reading x would alias tensors where torch
    forbids it: the program returning its input x, a higher-order op given x twice, a
    body returning a view of its input or one tensor twice (``replacement_refusal``).

    Costs: nothing; it removes casts.
    """

    def match(self, node: Node) -> bool:
        return same_dtype_cast(node)
