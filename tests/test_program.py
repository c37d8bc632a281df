"""fx16.program.Program: the one door to an ExportedProgram's state."""

import copy
import gc
import weakref

import pytest
import torch
from torch.export.graph_signature import InputKind

import fx16
from fx16.errors import InvalidProgramError, PassFailedError
from fx16.pipelines import run_passes
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


def test_one_program_per_cast_and_none_kept_after_it():
    """Program.of shares one Program among a cast's stages; once nothing holds it, the
    ExportedProgram the caller drops is freed, weights and all (a Program holds its
    program, so a cache that held Programs kept every cast program alive)."""
    # a copy: torch keeps the nodes of the graph it traced last until it traces again
    ep = copy.deepcopy(export(MixedBuffers(), torch.randn(2, 8)))
    program = Program.of(ep)
    assert Program.of(ep) is program and Program.of(program) is program
    del program
    fx16.cast_to_16_bit_precision(ep)
    program, graph_module = weakref.ref(ep), weakref.ref(ep.graph_module)
    weights = [weakref.ref(tensor) for tensor in ep.state_dict.values()]
    del ep
    gc.collect()
    assert program() is None and graph_module() is None
    assert all(weight() is None for weight in weights)


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


class _TiedMLP(torch.nn.Module):
    """Two linear layers and an embedding whose weight is tied to the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 32, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.relu(self.hidden(self.embed(ids))))


def _tied_program():
    torch.manual_seed(0)
    return export(_TiedMLP(), torch.randint(0, 32, (2, 5)))


def test_state_is_converted_only_when_the_transaction_commits():
    ep = _tied_program()
    program = Program(ep)
    with program.transaction():
        run_passes(fx16.fp16_passes(ep, calibration=[]), ep.graph_module)
        assert all(t.dtype == torch.float32 for t in ep.state_dict.values())
        assert program.state_dtype("hidden.weight") == torch.float16
    assert all(t.dtype == torch.float16 for t in ep.state_dict.values())
    assert ep.state_dict["embed.weight"] is ep.state_dict["out.weight"]  # still tied
    ids = torch.randint(0, 32, (2, 5))
    assert program.run((ids,))[0].dtype == torch.float16


def test_commit_frees_each_fp32_tensor_as_soon_as_it_is_replaced(monkeypatch):
    """With the program holding the only references, no fp32 original outlives its
    conversion: when a tensor is converted, every earlier original is already gone."""
    import fx16.program.state_commit

    ep = _tied_program()
    gc.collect()  # the exported module, if a reference cycle keeps it
    originals = [weakref.ref(t) for t in {id(t): t for t in ep.state_dict.values()}.values()]
    alive_at_each_conversion = []
    convert = fx16.program.state_commit.tensor_to_fp16

    def watched(tensor, *conversion):
        alive_at_each_conversion.append(sum(ref() is not None for ref in originals))
        return convert(tensor, *conversion)

    monkeypatch.setattr(fx16.program.state_commit, "tensor_to_fp16", watched)
    fx16.cast_fp32_to_fp16(ep, calibration=[])
    count = len(originals)
    assert alive_at_each_conversion == list(range(count, 0, -1))
    assert all(ref() is None for ref in originals)


def _second_conversion_fails(monkeypatch) -> list[int]:
    """Make the commit run out of memory on its second tensor; returns the sizes of
    the tensors it was asked to convert, in order."""
    import fx16.program.state_commit

    convert, sizes = fx16.program.state_commit.tensor_to_fp16, []

    def fails_second(tensor, *conversion):
        sizes.append(tensor.numel())
        if len(sizes) == 2:
            raise MemoryError("no room for the fp16 copy")
        return convert(tensor, *conversion)

    monkeypatch.setattr(fx16.program.state_commit, "tensor_to_fp16", fails_second)
    return sizes


def test_commit_keeps_the_callers_tensors_and_restores_them_on_failure(monkeypatch):
    ep = _tied_program()
    before = state_snapshot(ep)
    held = dict(ep.state_dict)  # the caller's references
    _second_conversion_fails(monkeypatch)
    with pytest.raises(PassFailedError, match="commit"):
        fx16.cast_fp32_to_fp16(ep, calibration=[])
    assert_same_state(before, state_snapshot(ep))
    assert all(ep.state_dict[name] is tensor for name, tensor in held.items())


def test_commit_failure_without_the_callers_tensors_leaves_a_runnable_fp32_program(
    monkeypatch,
):
    """The largest tensor goes first, so this can only happen if memory runs out for a
    smaller one after a larger one fit; a freed original comes back widened from
    its fp16 copy (equal to fp16 rounding), every dtype and the graph as before."""
    ep = _tied_program()
    ids = torch.randint(0, 32, (2, 5))
    sizes = _second_conversion_fails(monkeypatch)
    with pytest.raises(PassFailedError, match="commit"):
        fx16.cast_fp32_to_fp16(ep, calibration=[])
    assert sizes[0] == max(t.numel() for t in ep.state_dict.values())  # largest first
    assert all(t.dtype == torch.float32 for t in ep.state_dict.values())
    assert ep.state_dict["embed.weight"] is ep.state_dict["out.weight"]
    assert Program(ep).run((ids,))[0].dtype == torch.float32


def test_run_gives_the_user_outputs_of_the_module():
    ep = export(BufferUpdate(), torch.randn(3, 4), decompose=True)
    x = torch.randn(3, 4)
    got = Program(ep).run((x,))  # first: the module updates the program's buffer in place
    expected = ep.module()(x)
    torch.testing.assert_close(got, list(expected) if isinstance(expected, tuple) else [expected])


def test_the_commit_shows_a_progress_bar_when_asked(capsys):
    ep = _tied_program()
    fx16.cast_fp32_to_fp16(ep, calibration=[], progress=True)
    assert "fx16: converting weights" in capsys.readouterr().err
    fx16.cast_fp32_to_fp16(_tied_program(), calibration=[], progress=False)
    assert capsys.readouterr().err == ""


def test_a_snapshot_restores_the_pending_conversions_it_saw():
    """Conversions recorded after a snapshot are forgotten by its restore; those
    recorded before it are pending again, even after a commit in between."""
    ep = _tied_program()
    program = Program(ep)
    program.store_state("hidden.weight", torch.float16)
    saved = program.snapshot()
    program.store_state("hidden.bias", torch.float16)
    program.commit_state()
    assert program.state_tensor("hidden.bias").dtype == torch.float16
    saved.restore()
    assert program.state_dtype("hidden.bias") == torch.float32
    assert program.state_tensor("hidden.weight").dtype == torch.float32
    assert program.state_dtype("hidden.weight") == torch.float16


def test_an_added_constant_has_static_shapes_in_a_dynamic_program():
    """``add_constant`` gives the new placeholder a fake value of the program's mode
    with the constant's own sizes: no symbol of the batch dimension, nor a new one, so
    the program's range constraints stay those export wrote."""

    class Scale(torch.nn.Module):
        def forward(self, x):
            return x * 2

    batch = torch.export.Dim("batch")
    ep = torch.export.export(Scale(), (torch.randn(4, 3),), dynamic_shapes=({0: batch},))
    constraints = dict(ep.range_constraints)
    placeholder = Program(ep).add_constant("c", torch.ones(5, 3))
    val = placeholder.meta["val"]
    assert val.shape == (5, 3) and all(isinstance(size, int) for size in val.shape)
    user = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "x")
    assert val.fake_mode is user.meta["val"].fake_mode
    assert dict(ep.range_constraints) == constraints
    assert ep.constants["c0"].shape == (5, 3)
