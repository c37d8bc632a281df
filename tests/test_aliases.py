"""fx16.program.aliases: which values share storage, and whether a write reaches them."""

import torch

from fx16.program.aliases import alias_group, boundary_readers, storage_owners, written_in_place
from helpers import export


class ViewsAndCasts(torch.nn.Module):
    """x (a copy of the input) with two views, a cast of x and a view of the cast
    handed to a cond, and a write through one view of x."""

    def forward(self, inputs):
        x = inputs + 0
        flat, rows = x.view(-1), x[0]
        cast = x.to(torch.float64)
        chosen = torch.cond(x.sum() > 0, lambda c: c * 2.0, lambda c: c - 1.0, (cast.view(-1),))
        flat.add_(1)
        return rows * 1.0, chosen


def _program():
    ep = export(ViewsAndCasts(), torch.randn(2, 3))
    nodes = {node.name: node for node in ep.graph.nodes}
    return ep, nodes


def test_a_group_holds_the_views_and_what_they_view():
    ep, nodes = _program()
    group = alias_group([nodes["view"]])
    assert {nodes["add"], nodes["view"], nodes["select"]} <= group
    assert written_in_place(nodes["select"])  # add_ through the other view reaches it
    assert storage_owners(nodes["select"]) == [nodes["add"]]


def test_upward_false_keeps_only_what_derives_from_the_nodes():
    """The cast may alias x by its schema (a ``to`` to x's own dtype returns x), so the
    whole group reaches x's views; what derives from the cast alone is the cast, its
    view and the body placeholder the view becomes."""
    ep, nodes = _program()
    cast = next(n for n in ep.graph.nodes if n.name.startswith("to"))
    derived = alias_group([cast], upward=False)
    assert nodes["add"] in alias_group([cast])
    assert nodes["add"] not in derived and nodes["view"] not in derived
    (cast_view,) = [user for user in cast.users if user.target == torch.ops.aten.view.default]
    assert cast_view in derived
    for body in (ep.graph_module.true_graph_0, ep.graph_module.false_graph_0):
        (placeholder,) = body.graph.find_nodes(op="placeholder")
        assert placeholder in derived


def test_boundary_readers_are_the_ops_and_body_outputs_a_result_crosses_into():
    """The cast reaches the cond through a view; x's other view reaches none; inside a
    body, the value the body returns is read by its output (the program's own output
    does not count)."""
    ep, nodes = _program()
    top = ep.graph
    cast = next(n for n in top.nodes if n.name.startswith("to"))
    (cond,) = top.find_nodes(op="call_function", target=torch.ops.higher_order.cond)
    assert boundary_readers(cast, top) == {cond}
    assert boundary_readers(nodes["select"], top) == set()
    assert boundary_readers(nodes["mul"], top) == set()  # returned by the program itself
    body = ep.graph_module.true_graph_0.graph
    (returned,) = body.output_node().args[0]
    assert boundary_readers(returned, top) == {body.output_node()}
