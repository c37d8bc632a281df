"""CastRule: the shape every cast-cleanup rule shares (match, refusal, rewrite)."""

import torch
from torch._ops import HigherOrderOperator
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.analysis.facts import Facts
from fx16.ops.tables import ASSERT_METADATA_OPS
from fx16.passes.preserve_copies import pinned_across_a_boundary
from fx16.program import Program
from fx16.program.aliases import alias_group, written_in_place
from fx16.program.casts import (
    cast_dtype,
    cast_op_nodes,
    is_cast,
    is_inserted,
    represents_exactly,
    source_dtype,
)

# meta key: why a cleanup rule left a matching cast in place.
KEPT_CAST = "fx16.kept_cast"


class CastRule(PassBase):
    """A cleanup rule: one walk over its candidate nodes, rewriting each one it matches.

    Subclasses define ``match`` (is this node the rule's pattern?), ``refusal``
    (a reason not to rewrite it, or None) and ``rewrite``. A refusal is recorded in
    ``meta["fx16.kept_cast"]``. The output specs are kept in step with the graph.
    """

    def __init__(self, program: Program) -> None:
        self.program = Program.of(program)

    def candidates(self, graph: Graph) -> list[Node]:
        """The nodes ``match`` may accept, in graph order: by default the cast-op nodes
        (every rule's pattern starts at a cast), so a walk costs the number of casts."""
        return cast_op_nodes(graph)

    def match(self, node: Node) -> bool:
        raise NotImplementedError

    def refusal(self, node: Node) -> str | None:
        return None

    def rewrite(self, node: Node) -> None:
        raise NotImplementedError

    def call(self, graph_module: GraphModule) -> PassResult:
        modified = False
        for node in self.candidates(graph_module.graph):
            if node.graph is not graph_module.graph or not self.match(node):
                continue
            reason = self.refusal(node)
            if reason is None:
                self.rewrite(node)
                modified = True
            else:
                node.meta[KEPT_CAST] = reason
        if modified and graph_module is self.program.graph_module:
            self.program.sync_output_specs()
        Facts.invalidate(graph_module)  # nodes added, removed or rewired
        return PassResult(graph_module, modified)


class ReplaceBySource(CastRule):
    """A rule whose matches compute their first argument's value (a cast to the dtype it
    has, ``x * 1``): each is replaced by that argument unless ``replacement_refusal``
    says why not."""

    def refusal(self, node: Node) -> str | None:
        return replacement_refusal(node, in_body=node.graph is not self.program.graph_module.graph)

    def rewrite(self, node: Node) -> None:
        node.replace_all_uses_with(node.args[0])
        node.graph.erase_node(node)


def copy_refusal(cast: Node) -> str | None:
    """Why ``cast``'s copy (or another op's that copies its first argument) must stay
    apart from its source, or None when reading the source instead changes nothing: a
    write in place reaches one side (``fx16.program.aliases``)."""
    if written_in_place(cast, cast.args[0]):
        what = "cast" if is_cast(cast) else "op"
        return (
            f"a write in place reaches the {what}'s result or its source; the copy keeps them apart"
        )
    return None


def replacement_refusal(node: Node, in_body: bool) -> str | None:
    """Why ``node`` may not be replaced by its first argument, whose value it copies, or
    None: a write in place reaches either (``copy_refusal``); the program would return
    an input as an output; a body would read or return a conversion of the model's that
    may alias (``PreserveCopiesPass`` pins those on the next cast); or, where torch
    forbids it, a tensor would alias another: a higher-order op handed one tensor as two
    operands, a body (``in_body``) returning a view of its input or one tensor as two
    outputs."""
    written = copy_refusal(node)
    if written is not None:
        return written
    source = node.args[0]
    group = alias_group([source]) - {node}  # a cast to its own dtype may alias
    if pinned_across_a_boundary(source) and any(
        isinstance(user.target, HigherOrderOperator) or (in_body and user.op == "output")
        for user in node.users
    ):
        return (
            "removing it would hand a body the model's conversion itself, which a later "
            "cast pins as a copy (a second cast would change the program)"
        )
    for user in node.users:
        if user.op == "output":
            inputs = group if in_body else {source}
            if any(member.op == "placeholder" for member in inputs):
                return "removing it would return a program input as an output"
            if in_body and any(reader.op == "output" for m in group for reader in m.users):
                return "removing it would return one tensor as two outputs"
        elif isinstance(user.target, HigherOrderOperator) and group & set(user.all_input_nodes):
            return "removing it would hand a higher-order op one tensor as two operands"
    return None


def chain_refusal(inner: Node) -> str | None:
    """Why a cast ``outer(inner(x))`` of the cast ``inner`` may not read ``x`` directly,
    or None when it may.

    Never across a write in place (``copy_refusal``). Otherwise a cast fx16 inserted
    may be skipped freely: reading x instead loses nothing the
    model asked for (an fp32 value cast back to fp16 by fx16 and then cast to fp32
    by the model gives the model the unrounded value). A cast the model wrote may be
    skipped only when it loses nothing: x -> fp32 -> fp16 equals x -> fp16 for an
    fp16 x, but x -> fp16 -> fp32 rounds, so the model's narrowing stays.
    """
    written = copy_refusal(inner)
    if written is not None:
        return written
    if is_inserted(inner):
        return None
    if represents_exactly(source_dtype(inner), cast_dtype(inner)):
        return None
    return "the model narrows here on purpose (the chain changes range or resolution)"


def consumers(node: Node) -> list[Node]:
    """Users that compute with the value (``_assert_tensor_metadata`` checks only look at it)."""
    return [user for user in node.users if user.target not in ASSERT_METADATA_OPS]


def read_through(inner: Node, outer: Node) -> None:
    """Make ``outer`` read what ``inner`` reads; erase ``inner`` (and its checks) if now unused."""
    outer.args = (inner.args[0], *outer.args[1:])
    if not consumers(inner):
        for check in list(inner.users):
            check.graph.erase_node(check)
        inner.graph.erase_node(inner)


def is_cast_of_cast(node: Node) -> bool:
    """``node`` casts the result of another cast."""
    return is_cast(node) and isinstance(node.args[0], Node) and is_cast(node.args[0])


def same_dtype_cast(node: Node) -> bool:
    return is_cast(node) and cast_dtype(node) == source_dtype(node)


def dtype_groups(casts: list[Node]) -> dict[torch.dtype, list[Node]]:
    groups: dict[torch.dtype, list[Node]] = {}
    for cast in casts:
        groups.setdefault(cast_dtype(cast), []).append(cast)
    return groups
