"""Which values of a graph share storage, and whether a write in place reaches them.

A graph with in-place ops (``add_``, ``masked_fill_``, ``copy_``) gives its nodes
reference semantics: a node that returns a view of its input, or the input itself
(``view``, ``select``, a ``to`` that changes nothing), shares that input's storage,
and a write through one is seen through the other. The op schemas say which
results share storage with which arguments (``Tensor(a) self -> Tensor(a)``); a
value that crosses into a higher-order op's body is the same storage there.

A cast rewrite that would make a copy into an alias (dropping a cast whose input
already has its dtype, reading a cast's source instead of the cast) is safe only
when no write in place reaches either side: ``written_in_place`` answers that,
conservatively (an ``operator.getitem`` shares storage with what it reads).
"""

import operator
from typing import Any

from torch._ops import HigherOrderOperator
from torch.fx import Graph, Node

from fx16.ops.tables import per_op
from fx16.program.nodes import mutated_argument
from fx16.program.subgraphs import bodies_and_operands


@per_op
def _aliasing_arguments(target: Any) -> tuple[int, ...]:
    """Positions of the arguments an op's results may share storage with."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return ()
    returned = set()
    for result in schema.returns:
        if result.alias_info is not None:
            returned |= set(result.alias_info.before_set)
    return tuple(
        index
        for index, argument in enumerate(schema.arguments)
        if argument.alias_info is not None
        and (
            set(argument.alias_info.before_set) & returned
            # ``Tensor(a -> *)``: the results (a list of views, as chunk and split give) may
            # alias it; the bindings do not show a list's element alias sets
            or "*" in argument.alias_info.after_set
        )
    )


def _shares_storage_with(user: Node, value: Node) -> bool:
    """``user``'s result may be (a view of) ``value``."""
    if user.target is operator.getitem:
        return user.args[0] is value
    if user.op != "call_function":
        return False
    return any(
        index < len(user.args) and user.args[index] is value
        for index in _aliasing_arguments(user.target)
    )


def _body_placeholders(user: Node, value: Node) -> list[Node]:
    """The placeholders ``value`` becomes inside the bodies of higher-order op ``user``."""
    body_nodes, operands = bodies_and_operands(user)
    if not body_nodes:
        return []
    owner = user.graph.owning_module
    found = []
    for body_node in body_nodes:
        placeholders = getattr(owner, body_node.target).graph.find_nodes(op="placeholder")
        found.extend(p for p, operand in zip(placeholders, operands) if operand is value)
    return found


def alias_group(nodes: list[Node], upward: bool = True) -> set[Node]:
    """``nodes`` and every node that may share storage with one of them: the views of
    them (and views of those), what they are views of, and the placeholders they
    become inside bodies. ``upward=False`` leaves out what they are views of (and
    its other views): only what derives from ``nodes``' own results."""
    group, pending = set(), list(nodes)
    while pending:
        node = pending.pop()
        if node in group:
            continue
        group.add(node)
        for user in node.users:
            if _shares_storage_with(user, node):
                pending.append(user)
            pending.extend(_body_placeholders(user, node))
        if upward and node.op == "call_function":
            pending.extend(arg for arg in node.all_input_nodes if _shares_storage_with(node, arg))
    return group


def boundary_readers(node: Node, top: Graph) -> set[Node]:
    """What reads ``node``'s own result (or a view of it, in a body too) across a body's
    boundary: the higher-order ops given it as an operand, and the output of a body (a
    graph other than the program's, ``top``) returning it. torch refuses a higher-order
    op operands that alias each other, and a body outputs that alias its inputs or
    each other, so two values with a reader in common must not become one tensor."""
    return {
        user
        for member in alias_group([node], upward=False)
        for user in member.users
        if isinstance(user.target, HigherOrderOperator)
        or (user.op == "output" and user.graph is not top)
    }


def written_in_place(*nodes: Node) -> bool:
    """A write in place reaches some node of ``nodes`` or a value sharing its storage."""
    group = alias_group(list(nodes))
    return any(mutated_argument(user) in group for member in group for user in member.users)


def storage_owners(node: Node) -> list[Node]:
    """The ops that made the storage a write into ``node`` reaches: the members of its
    alias group computed by an op whose result is a view of none of its inputs (a
    program input or a body's placeholder owns nothing a cast can change)."""
    return [
        member
        for member in alias_group([node])
        if member.op == "call_function"
        and not any(_shares_storage_with(member, arg) for arg in member.all_input_nodes)
    ]
