"""fx16.program.Program: the one door to an ExportedProgram's state."""

import pytest
import torch
from torch.export.graph_signature import InputKind

import fx16
from fx16.errors import InvalidProgramError, PassFailedError
from fx16.program import Program
from helpers import assert_same_state, check_program, export, state_snapshot
from models import BufferUpdate, MixedBuffers


def test_state_slots_name_every_state_placeholder():
    ep = export(MixedBuffers(), torch.randn(2, 8))
    slots = Program(ep).state_slots()
    assert {s.target for s in slots} == set(ep.state_dict)
    assert all(s.kind == InputKind.BUFFER for s in slots)
    assert all(s.placeholder.op == "placeholder" for s in slots)


def test_replace_state_tensor_keeps_parameter_wrapper():
    ep = export(torch.nn.Linear(2, 2), torch.randn(1, 2))
    program = Program(ep)
    program.replace_state_tensor("weight", torch.zeros(2, 2, dtype=torch.float16))
    assert isinstance(ep.state_dict["weight"], torch.nn.Parameter)
    assert program.state_tensor("weight").dtype == torch.float16


def test_graph_inputs_run_the_graph_like_the_module():
    model = MixedBuffers()
    x = torch.randn(2, 8)
    ep = export(model, x)
    direct = ep.graph_module(*Program(ep).graph_inputs((x,)))
    unlifted = ep.module()(x)
    for a, b in zip(direct, unlifted):
        torch.testing.assert_close(a, b)


def test_required_output_dtypes_cover_buffer_mutations():
    ep = export(BufferUpdate(), torch.randn(3, 4), decompose=True)
    assert Program(ep).required_output_dtypes() == {0: torch.float32}


def test_transaction_restores_everything_and_wraps_the_error():
    ep = export(MixedBuffers(), torch.randn(2, 8))
    program = Program(ep)
    before = state_snapshot(ep)
    with pytest.raises(PassFailedError) as caught:
        with program.transaction():
            program.replace_state_tensor("scale", torch.zeros(8, dtype=torch.float16))
            next(iter(ep.graph_module.graph.nodes)).name = "renamed"
            ep.graph_module.recompile()
            ep.graph_signature.output_specs[0].arg.name = "renamed"
            raise ValueError("boom")
    assert isinstance(caught.value.__cause__, ValueError)
    assert_same_state(before, state_snapshot(ep))


def test_transaction_passes_fx16_errors_through():
    ep = export(MixedBuffers(), torch.randn(2, 8))
    with pytest.raises(InvalidProgramError):
        with Program(ep).transaction():
            raise InvalidProgramError("already ours")


def test_not_a_program():
    with pytest.raises(InvalidProgramError, match="ExportedProgram"):
        Program(torch.nn.Linear(2, 2))


class DeadBeforeAutocast(torch.nn.Module):
    """The shape the fuzzer found: a dead op, then an autocast region."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x):
        h = x.abs()
        h.abs()  # dead
        with torch.autocast("cpu", dtype=torch.bfloat16):
            g = self.fc(x).relu()
        return g.float() + h, x.abs() * 1.0


def test_a_node_missing_from_its_inputs_users_is_registered():
    ep = export(DeadBeforeAutocast(), torch.randn(2, 2))
    graph = ep.graph_module.graph
    dead = next(n for n in graph.nodes if n.target == torch.ops.aten.abs.default and not n.users)
    dead.args[0].users.pop(dead, None)  # what torch.export 2.13 leaves (and a guard if fixed)
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    assert all(n in arg.users for n in graph.nodes for arg in n.all_input_nodes)
