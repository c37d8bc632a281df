"""fx16.program.names: every name a user gives must name something; outputs by position or the
model's own name."""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings

import fx16
from fx16 import InvalidOptionError, PrecisionPolicy
from fx16.program import Program
from fx16.program.names import check_names, kept_output_positions, output_names
from fx16.testing import programs
from helpers import assert_same_state, export, state_snapshot


class TwoLayers(torch.nn.Module):
    """Two linear layers returning a dict: outputs named "out" and "aux"."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return {"out": x, "aux": x.sum(-1)}


def _program():
    torch.manual_seed(0)
    return export(TwoLayers(), torch.randn(2, 4))


@pytest.mark.parametrize(
    "options, words",
    [
        ({"keep_io_types": ["nosuch"]}, "keep_io_types names nothing in this program: 'nosuch'"),
        (
            {"policy": PrecisionPolicy.custom(modules={"layers.9": "fp32"})},
            "policy modules names nothing in this program: 'layers.9'; closest: ",
        ),
        (
            {"policy": PrecisionPolicy.custom(nodes={"linear_999": "fp32"})},
            "policy nodes names nothing in this program: 'linear_999'; closest: linear",
        ),
        ({"policy": PrecisionPolicy.custom(ops={"softmx": "fp32"})}, "no ATen op: 'softmx'"),
        ({"policy": PrecisionPolicy.custom(ops={"linear.nosuch": "fp32"})}, "'linear.nosuch'"),
        ({"force_fp32": frozenset({"nope"})}, "force_fp32 names nothing in this program"),
    ],
)
def test_a_name_that_matches_nothing_is_refused_and_changes_nothing(options, words):
    ep = _program()
    before = state_snapshot(ep)
    cast = fx16.cast_to_16_bit_precision if "force_fp32" in options else fx16.cast_fp32_to_fp16
    with pytest.raises(InvalidOptionError, match=words.replace("(", r"\(")) as raised:
        cast(ep, **options)
    assert "\n" not in str(raised.value)
    assert_same_state(state_snapshot(ep), before)


def test_an_op_is_named_by_its_packet_or_by_an_overload_as_inspect_prints_it():
    """``ops={"linear.default": ...}`` (the overload form ``fx16 inspect`` prints) was
    refused as naming no ATen op; it overrides that overload."""
    ep = fx16.cast_fp32_to_fp16(
        _program(), policy=PrecisionPolicy.custom(ops={"linear.default": "fp32"})
    )
    linears = [n for n in ep.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert linears and all(n.meta["val"].dtype == torch.float32 for n in linears)


def test_the_error_lists_the_names_there_are():
    with pytest.raises(InvalidOptionError) as raised:
        fx16.fp16_passes(_program(), keep_io_types=["nosuch"])
    assert "x, 0 or out, 1 or aux" in str(raised.value)  # the input, each output both ways


def test_outputs_have_the_models_names():
    assert output_names(Program(_program())) == ["out", "aux"]

    class Nested(torch.nn.Module):
        def forward(self, x):
            return x + 1, {"a": x * 2}

    assert output_names(Program(export(Nested(), torch.randn(2)))) == ["0", "1.a"]


@pytest.mark.parametrize(
    "kept, stays_fp32",
    [(["out"], {"out"}), ([1], {"aux"}), (["0", "aux"], {"out", "aux"}), (True, {"out", "aux"})],
)
def test_keep_io_types_addresses_outputs_by_position_and_by_name(kept, stays_fp32):
    ep = fx16.cast_fp32_to_fp16(_program(), keep_io_types=kept)
    args, kwargs = fx16.inputs_for(ep, torch.randn(2, 4))
    outputs = ep.module()(*args, **kwargs)
    assert {name for name, value in outputs.items() if value.dtype == torch.float32} == stays_fp32


def test_names_that_exist_are_accepted_on_every_route():
    policy = PrecisionPolicy.custom(modules={"layers.1": "fp32"}, nodes={"linear": "fp32"})
    ep = fx16.cast_fp32_to_fp16(_program(), policy=policy, keep_io_types=["x", "aux"])
    assert ep.module()(torch.randn(2, 4))["aux"].dtype == torch.float32
    assert fx16.fp16_passes(_program(), policy=policy)


def test_one_name_may_be_given_without_a_list():
    """keep_io_types="aux", force_fp32="linear": one name, not a set of its letters."""
    ep = fx16.cast_to_16_bit_precision(_program(), keep_io_types="aux", force_fp32="linear")
    nodes = {node.name: node for node in ep.graph_module.graph.nodes}
    assert nodes["linear"].meta["val"].dtype == torch.float32
    assert ep.module()(torch.randn(2, 4).half())["aux"].dtype == torch.float32


@settings(max_examples=examples(8), deadline=None)
@given(programs())
def test_every_name_a_program_has_is_accepted_and_outputs_answer_to_their_positions(case):
    """On any program: each node name (bodies too) is a valid node override and
    force_fp32 entry, each output is addressable by position, and the model's output
    names are as many as its user outputs."""
    ep = case.export()
    program = Program(ep)
    graphs = [m.graph for m in ep.graph_module.modules() if hasattr(m, "graph")]
    names = {node.name for graph in graphs for node in graph.nodes}
    policy = PrecisionPolicy.custom(
        nodes=dict.fromkeys(names, "16-bit"),
        keep_io_types=range(len(output_names(program))),
    )
    check_names(program, policy, names)
    assert len(kept_output_positions(program, policy.keep_io_types)) == len(output_names(program))
