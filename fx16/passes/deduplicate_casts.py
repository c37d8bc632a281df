"""DeduplicateCastsPass: one cast per (value, dtype)."""

from torch.fx import Graph, Node

from fx16.passes.cast_rule import CastRule, copy_refusal, dtype_groups
from fx16.program.aliases import boundary_readers
from fx16.program.casts import INSERTED, is_cast, is_inserted


class DeduplicateCastsPass(CastRule):
    """Casts of the same value to the same dtype are merged into the first one.

    Input graph:  x -> to(f32) -> a;  x -> to(f32) -> b
    Output graph: x -> c=to(f32) -> {a, b}

    The survivor counts as the model's own cast if any merged cast was, so later
    rules stay as strict with it. Casts whose result is written in place are not merged.
    Nor are two casts (or views of them) that one higher-order op reads, or one body
    returns: merged, torch would refuse the op its operands (one tensor as two, as
    ``torch.cond``'s functionalization does) or the body its outputs. A value whose
    casts all stay apart so records why (``meta["fx16.kept_cast"]``).

    Costs: nothing; it removes casts.
    """

    def candidates(self, graph: Graph) -> list[Node]:
        """The values some cast reads (the pattern starts at the value, not a cast)."""
        casts = super().candidates(graph)
        return sorted({cast.args[0] for cast in casts if isinstance(cast.args[0], Node)})

    def match(self, node: Node) -> bool:
        return bool(_same_dtype_casts(node))

    def refusal(self, node: Node) -> str | None:
        if self._mergeable(node):
            return None
        return (
            "its casts to one dtype feed one higher-order op or body output: merged, "
            "that op would read one tensor as two"
        )

    def rewrite(self, node: Node) -> None:
        for group in self._mergeable(node):
            keeper, duplicates = group[0], group[1:]
            if not all(is_inserted(cast) for cast in group):
                keeper.meta.pop(INSERTED, None)
            for duplicate in duplicates:
                duplicate.replace_all_uses_with(keeper)
                duplicate.graph.erase_node(duplicate)

    def _mergeable(self, node: Node) -> list[list[Node]]:
        """``_same_dtype_casts(node)``, each split, in graph order, into the groups that
        may become one node: no two members read by one higher-order op or returned by
        one body's output."""
        top = self.program.graph_module.graph
        merges = []
        for casts in _same_dtype_casts(node):
            groups: list[tuple[list[Node], set[Node]]] = []
            for cast in sorted(casts):  # fx nodes order by their position in the graph
                readers = boundary_readers(cast, top)
                group = next((g for g in groups if not g[1] & readers), None)
                if group is None:
                    groups.append(([cast], readers))
                else:
                    group[0].append(cast)
                    group[1].update(readers)
            merges += [members for members, _ in groups if len(members) > 1]
        return merges


def _same_dtype_casts(node: Node) -> list[list[Node]]:
    """The groups of two or more casts of ``node`` to one dtype that a write in place
    leaves apart from nothing (``copy_refusal``, asked only of the casts that share a
    dtype with another: the question walks alias groups)."""
    casts = [user for user in node.users if is_cast(user) and user.args[0] is node]
    groups = []
    for group in dtype_groups(casts).values():
        if len(group) > 1:
            group = [cast for cast in group if copy_refusal(cast) is None]
            if len(group) > 1:
                groups.append(group)
    return groups
