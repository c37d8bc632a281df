"""RemoveUnusedCastsPass: erase casts nothing reads."""

from torch.fx import Node

from fx16.passes.cast_rule import CastRule
from fx16.program.casts import is_cast


class RemoveUnusedCastsPass(CastRule):
    """A cast with no users computes nothing anyone needs: erase it.

    Input graph:  x -> to(i32)   (no users; its readers were moved to x)
    Output graph: x

    Casts are pure, so this holds for the model's casts as much as for inserted ones.

    Costs: nothing; it removes casts.
    """

    def match(self, node: Node) -> bool:
        return is_cast(node) and not node.users

    def rewrite(self, node: Node) -> None:
        node.graph.erase_node(node)
