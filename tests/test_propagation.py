"""fx16.program.propagation: output dtypes after inputs change, fake-run or remembered."""

import torch

from fx16.program.casts import retype_val
from fx16.program.propagation import fresh_result, propagate_fake, retyped_result
from helpers import export


class TwoNorms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.LayerNorm(8), torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.second(self.first(x) * 2.0)


def _norms(ep):
    return [n for n in ep.graph_module.graph.nodes if "layer_norm" in str(n.target)]


def test_remembered_dtypes_equal_a_fake_run_for_every_node():
    ep = export(TwoNorms(), torch.randn(2, 3, 8)).run_decompositions()  # native_layer_norm
    norms = _norms(ep)
    assert len(norms) == 2 and isinstance(norms[0].meta["val"], tuple)
    for node in norms:  # inputs become fp16, as the inserter leaves them before asking
        for arg in node.all_input_nodes:
            arg.meta["val"] = retype_val(arg.meta["val"], torch.float16)
    for node in norms:  # the second node's answer comes from what the first one taught
        expected = propagate_fake(node)
        got = retyped_result(node)
        assert [t.dtype for t in got] == [t.dtype for t in expected]
        assert [t.shape for t in got] == [t.shape for t in expected]
        assert got[0].dtype == torch.float16


class AbsTwice(torch.nn.Module):
    """abs of a contiguous tensor twice, and of a transposed view of it."""

    def forward(self, x):
        return x.abs() + 1, (x * 2).abs(), x.t().abs()


def test_fresh_results_are_shared_only_between_equal_layouts():
    """Two abs of contiguous 4x6 inputs share one fake result, equal to a fake run's;
    the abs of a transposed view gets its own, with the strides the view gives."""
    ep = export(AbsTwice(), torch.randn(4, 6))
    first, second, transposed = [
        n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.abs.default
    ]
    made = [fresh_result(node) for node in (first, second, transposed)]
    assert made[0] is made[1]
    for node, value in zip((first, second, transposed), made):
        expected = propagate_fake(node)
        assert (value.shape, value.stride(), value.dtype) == (
            expected.shape,
            expected.stride(),
            expected.dtype,
        )
    assert made[2] is not made[0] and made[2].stride() != made[0].stride()


def test_a_fresh_result_asked_about_the_same_input_values_is_answered_by_identity(monkeypatch):
    """Asked again about inputs holding the very values an earlier ask read, the
    answer is the same result without describing any layout again; an input given a
    new value (fp16 now) is described and answered anew, with its dtype."""
    from fx16.program import propagation

    ep = export(AbsTwice(), torch.randn(4, 6))
    first = next(n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.abs.default)
    described = []
    layout = propagation._layout
    monkeypatch.setattr(
        propagation, "_layout", lambda value: described.append(value) or layout(value)
    )
    made = fresh_result(first)
    assert len(described) == 1
    assert fresh_result(first) is made and len(described) == 1
    source = first.args[0]
    source.meta["val"] = retype_val(source.meta["val"], torch.float16)
    assert fresh_result(first).dtype == torch.float16 and len(described) == 2
