"""ConvertUserInputsPass: fp32 user inputs are declared fp16, other inputs untouched."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fx16.passes import ConvertUserInputsPass
from fx16.program import Program
from helpers import export, node_named


class TwoInputs(torch.nn.Module):
    def forward(self, x, ids, mask):
        return x[ids] * mask


def test_only_fp32_inputs_change():
    """x:f32, ids:i64, mask:f16   becomes   x:f16, ids:i64, mask:f16."""
    args = (torch.randn(5, 3), torch.tensor([0, 2]), torch.ones(2, 3, dtype=torch.float16))
    ep = export(TwoInputs(), *args)
    result = ConvertUserInputsPass(Program(ep))(ep.graph_module)
    assert result.modified
    assert node_named(ep, "x").meta["val"].dtype == torch.float16
    assert node_named(ep, "ids").meta["val"].dtype == torch.int64
    assert node_named(ep, "mask").meta["val"].dtype == torch.float16
    example_args, _ = ep.example_inputs
    assert [a.dtype for a in example_args] == [torch.float16, torch.int64, torch.float16]


def test_no_float_inputs_means_not_modified():
    class Ids(torch.nn.Module):
        def forward(self, ids):
            return ids + 1

    ep = export(Ids(), torch.tensor([1, 2]))
    assert not ConvertUserInputsPass(Program(ep))(ep.graph_module).modified


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool]),
        min_size=1,
        max_size=4,
    )
)
def test_exactly_the_fp32_inputs_change(dtypes):
    class Many(torch.nn.Module):
        def forward(self, *inputs):
            return tuple(value.clone() for value in inputs)

    args = tuple(torch.ones(3).to(dtype) for dtype in dtypes)
    ep = export(Many(), *args)
    ConvertUserInputsPass(Program(ep))(ep.graph_module)
    placeholders = Program(ep).user_input_placeholders()
    for dtype, placeholder in zip(dtypes, placeholders):
        expected = torch.float16 if dtype == torch.float32 else dtype
        assert placeholder.meta["val"].dtype == expected
