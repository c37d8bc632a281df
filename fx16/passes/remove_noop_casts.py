"""RemoveNoopCastsPass: drop casts whose input already has the target dtype."""

from torch.fx import Node

from fx16.passes.cast_rule import CastRule, copy_refusal, same_dtype_cast


class RemoveNoopCastsPass(CastRule):
    """``to(x, d)`` with x already of dtype d is replaced by x.

    Input graph:  x:f16 -> _to_copy(f16) -> y
    Output graph: x:f16 -> y

    Refuses when a write in place reaches the result or x, through any view of either
    (the copy keeps them apart), or
    when x is a placeholder returned by the program (an output would alias an input).

    Costs: nothing; it removes casts.
    """

    def match(self, node: Node) -> bool:
        return same_dtype_cast(node)

    def refusal(self, node: Node) -> str | None:
        written = copy_refusal(node)
        if written is not None:
            return written
        source = node.args[0]
        if source.op == "placeholder" and any(user.op == "output" for user in node.users):
            return "removing it would return a program input as an output"
        return None

    def rewrite(self, node: Node) -> None:
        node.replace_all_uses_with(node.args[0])
        node.graph.erase_node(node)
