"""fx16.program.subgraphs: where each higher-order op keeps its bodies and what feeds them."""

import torch

from fx16.program.subgraphs import bodies_and_operands, carried_count, with_operands
from helpers import export
from models import AutocastRegions, Branches, GrowingLoop, MappedLayer


def _only(ep, target):
    (node,) = [n for n in ep.graph_module.graph.nodes if n.target is target]
    return node


def _placeholders(ep, body):
    return getattr(ep.graph_module, body.target).graph.find_nodes(op="placeholder")


def _check(ep, node):
    """Each body is a GraphModule of the program taking exactly the operands listed."""
    bodies, operands = bodies_and_operands(node)
    assert bodies and all(body.op == "get_attr" for body in bodies)
    for body in bodies:
        assert len(_placeholders(ep, body)) == len(operands)
    return bodies, operands


def test_cond_feeds_both_branches_its_operands():
    ep = export(Branches(), torch.randn(2, 4))
    cond = _only(ep, torch.ops.higher_order.cond)
    bodies, operands = _check(ep, cond)
    assert len(bodies) == 2 and operands == list(cond.args[3])
    assert carried_count(cond) == 0


def test_while_loop_feeds_its_state_then_the_other_inputs():
    ep = export(GrowingLoop(), torch.randn(2, 8))
    loop = _only(ep, torch.ops.higher_order.while_loop)
    bodies, operands = _check(ep, loop)
    assert [body.target for body in bodies] == [loop.args[0].target, loop.args[1].target]
    assert operands == [*loop.args[2], *loop.args[3]]
    assert carried_count(loop) == len(loop.args[2]) == 2


def test_map_feeds_the_mapped_tensors_then_the_others():
    ep = export(MappedLayer(), torch.randn(3, 2, 8))
    mapped = _only(ep, torch.ops.higher_order.map_impl)
    _, operands = _check(ep, mapped)
    assert operands[0].name == "xs" and carried_count(mapped) == 0


def test_autocast_regions_and_other_nodes():
    ep = torch.export.export(AutocastRegions(), (torch.randn(3, 8),))
    regions = 0
    for node in ep.graph_module.graph.nodes:
        if node.target is torch.ops.higher_order.wrap_with_autocast:
            regions += 1
            _, operands = _check(ep, node)
            assert operands == list(node.args[5:])
        elif node.op == "call_function":
            assert bodies_and_operands(node) == ([], [])
    assert regions == 2  # the disabled and the enabled region


def test_with_operands_puts_each_operand_back_where_it_came_from():
    """For cond, while_loop and map: the arguments rebuilt from the operands listed are
    the node's own, and a changed list changes only its own positions."""
    cases = [
        (Branches(), torch.randn(2, 4), torch.ops.higher_order.cond),
        (GrowingLoop(), torch.randn(2, 8), torch.ops.higher_order.while_loop),
        (MappedLayer(), torch.randn(3, 2, 8), torch.ops.higher_order.map_impl),
    ]
    for model, x, target in cases:
        node = _only(export(model, x), target)
        operands = bodies_and_operands(node)[1]
        assert with_operands(node, operands) == node.args
        marked = [
            "marked" if index == len(operands) - 1 else value
            for index, value in enumerate(operands)
        ]
        rebuilt = with_operands(node, marked)
        node.args = rebuilt
        assert bodies_and_operands(node)[1] == marked
