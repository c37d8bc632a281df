"""fx16.program.propagation: output dtypes after inputs change, fake-run or remembered."""

import torch

from fx16.program.casts import retype_val
from fx16.program.propagation import propagate_fake, retyped_result
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
