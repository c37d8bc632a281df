"""BypassBranchingCastsPass: a cast reading a shared cast reads the shared cast's input."""

from torch.fx import Node

from fx16.passes.cast_rule import (
    CastRule,
    chain_refusal,
    consumers,
    is_cast_of_cast,
    read_through,
)


class BypassBranchingCastsPass(CastRule):
    """``c = to(x, a)`` with several users; a user ``to(c, b)`` becomes ``to(x, b)``.

    Input graph:  x:f16 -> c=to(f32) -> {relu, to(f16) -> y}
    Output graph: x:f16 -> c=to(f32) -> relu;  x -> to(f16) -> y

    The shared cast stays for its other users. Same refusal as FuseCastChainsPass.

    Costs: nothing; a cast is read from its source instead.
    """

    def match(self, node: Node) -> bool:
        return is_cast_of_cast(node) and len(consumers(node.args[0])) > 1

    def refusal(self, node: Node) -> str | None:
        return chain_refusal(node.args[0])

    def rewrite(self, node: Node) -> None:
        read_through(node.args[0], node)
