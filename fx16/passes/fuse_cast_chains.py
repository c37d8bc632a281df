"""FuseCastChainsPass: collapse a cast that only feeds another cast."""

from torch.fx import Node

from fx16.passes.cast_rule import (
    CastRule,
    chain_refusal,
    consumers,
    is_cast_of_cast,
    read_through,
)


class FuseCastChainsPass(CastRule):
    """``to(to(x, a), b)`` with the inner cast used only there becomes ``to(x, b)``.

    Input graph:  x:f16 -> to(f32) -> to(f16) -> y
    Output graph: x:f16 -> to(f16) -> y   (then RemoveNoopCastsPass leaves x -> y)

    Counter-example, refused: x:f32 -> to(f16) -> to(f32) written by the model
    rounds x to fp16 on purpose; fusing it would change the values.

    Costs: nothing; it removes casts.
    """

    def match(self, node: Node) -> bool:
        return is_cast_of_cast(node) and len(consumers(node.args[0])) == 1

    def refusal(self, node: Node) -> str | None:
        return chain_refusal(node.args[0])

    def rewrite(self, node: Node) -> None:
        read_through(node.args[0], node)
