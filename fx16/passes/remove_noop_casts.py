"""RemoveNoopCastsPass: drop casts whose input already has the target dtype."""

from torch.fx import Node

from fx16.passes.cast_rule import CastRule, is_written_in_place, same_dtype_cast


class RemoveNoopCastsPass(CastRule):
    """``to(x, d)`` with x already of dtype d is replaced by x.

    Input graph:  x:f16 -> _to_copy(f16) -> y
    Output graph: x:f16 -> y

    Refuses when the cast's result is written in place (the copy protects x), or
    when x is a placeholder returned by the program (an output would alias an input).
    """

    def match(self, node: Node) -> bool:
        return same_dtype_cast(node)

    def refusal(self, node: Node) -> str | None:
        if is_written_in_place(node):
            return "its result is written in place; the copy keeps the input intact"
        source = node.args[0]
        if source.op == "placeholder" and any(user.op == "output" for user in node.users):
            return "removing it would return a program input as an output"
        return None

    def rewrite(self, node: Node) -> None:
        node.replace_all_uses_with(node.args[0])
        node.graph.erase_node(node)
