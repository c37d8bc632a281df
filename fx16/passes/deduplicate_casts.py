"""DeduplicateCastsPass: one cast per (value, dtype)."""

from torch.fx import Graph, Node

from fx16.passes.cast_rule import CastRule, copy_refusal, dtype_groups
from fx16.program.casts import INSERTED, is_cast, is_inserted


class DeduplicateCastsPass(CastRule):
    """Casts of the same value to the same dtype are merged into the first one.

    Input graph:  x -> to(f32) -> a;  x -> to(f32) -> b
    Output graph: x -> c=to(f32) -> {a, b}

    The survivor counts as the model's own cast if any merged cast was, so later
    rules stay as strict with it. Casts whose result is written in place are not merged.

    Costs: nothing; it removes casts.
    """

    def candidates(self, graph: Graph) -> list[Node]:
        """The values some cast reads (the pattern starts at the value, not a cast)."""
        casts = super().candidates(graph)
        return sorted({cast.args[0] for cast in casts if isinstance(cast.args[0], Node)})

    def match(self, node: Node) -> bool:
        return bool(self._duplicated(node))

    def rewrite(self, node: Node) -> None:
        for group in self._duplicated(node):
            group.sort()  # fx nodes order by their position in the graph
            keeper, duplicates = group[0], group[1:]
            if not all(is_inserted(cast) for cast in group):
                keeper.meta.pop(INSERTED, None)
            for duplicate in duplicates:
                duplicate.replace_all_uses_with(keeper)
                duplicate.graph.erase_node(duplicate)

    @staticmethod
    def _duplicated(node: Node) -> list[list[Node]]:
        """The groups of two or more casts of ``node`` to one dtype that may merge. A
        cast a write in place reaches is left out (``copy_refusal``), asked only of the
        casts that share a dtype with another: the question walks alias groups."""
        casts = [user for user in node.users if is_cast(user) and user.args[0] is node]
        groups = []
        for group in dtype_groups(casts).values():
            if len(group) > 1:
                group = [cast for cast in group if copy_refusal(cast) is None]
                if len(group) > 1:
                    groups.append(group)
        return groups
