"""A bf16 checkpoint cast to fp16 tensor by tensor: the widening to fp32 that lets the
fp32 rules decide is a decision (``Program.store_state``), not a copy. Runs during the
cast (calibration, emulation) widen each weight as they read it; the commit stores each
bf16 tensor fp16 directly, or fp32 where the cast kept it so. These tests check that
no fp32 copy of the weights is ever whole, and that the decisions and stored tensors
are those of the fp32 cast of the same weights widened."""

import copy
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fx16
from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.decisions import decision_of
from fx16.errors import PassFailedError
from fx16.program import Program
from fx16.program.interpreter import LeanInterpreter
from fx16.program.snapshot import PENDING
from helpers import check_program, export, fp64_reference, max_error, run

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
WIDTH, LAYERS = 128, 8


class Stack(nn.Module):
    """Equal linear layers (one ``WIDTH x WIDTH`` weight each) with RMSNorms, one layer's
    weight scaled past fp16's range (~3e5): the cast must carry it at a scale."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.RMSNorm(WIDTH) for _ in range(LAYERS))
        with torch.no_grad():
            self.layers[3].weight.mul_(3e6)

    def forward(self, x):
        for layer, norm in zip(self.layers, self.norms):
            x = x + layer(norm(x))
        return x


def _bf16_model():
    torch.manual_seed(0)
    return Stack().eval().to(BF16), torch.randn(4, WIDTH)


class _Fp32Held(TorchDispatchMode):
    """The most bytes of fp32 storage held at once, looked at after every op: the
    program's fp32 state tensors, and what ops made (not views) that is still alive."""

    def __init__(self, ep) -> None:
        super().__init__()
        self.ep, self.made, self.peak = ep, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in torch.utils._pytree.tree_leaves(out):
            if type(leaf) is torch.Tensor and leaf.dtype == FP32 and not leaf._is_view():
                storage = leaf.untyped_storage()
                self.made[storage.data_ptr()] = storage.nbytes()
                weakref.finalize(leaf, self.made.pop, storage.data_ptr(), None)
        held = dict(self.made)
        for tensor in self.ep.state_dict.values():
            if tensor.dtype == FP32:
                held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(held.values()))
        return out


def test_a_bf16_cast_never_holds_an_fp32_copy_of_its_weights():
    """The most fp32 bytes held at once during the cast of a bf16 program with eight
    equal weights (its state, and every tensor an op made) is below three weights' fp32
    copies: one weight widened for the op reading it, its emulated rounding, the
    activations. Widening the program's state first, as the cast once did, held all
    eight until the commit."""
    model, x = _bf16_model()
    one_weight = WIDTH * WIDTH * 4
    ep = export(model, x)
    held = _Fp32Held(ep)
    with held:
        fx16.cast_to_16_bit_precision(ep, calibration=[(x,)])
    assert held.peak < 3 * one_weight, held.peak


def test_a_bf16_cast_decides_and_stores_as_the_fp32_cast_of_its_weights_widened():
    """The bf16 program and its weights widened to fp32 cast to the same program: every
    node's decision and value dtype, every stored tensor bit for bit (the loud layer's
    weight scaled into fp16's range in both), and outputs within fp16's bound of fp64."""
    model, x = _bf16_model()
    wide = copy.deepcopy(model).float()
    cast = fx16.cast_to_16_bit_precision(export(model, x), calibration=[(x,)])
    reference = fx16.cast_to_16_bit_precision(export(wide, x), calibration=[(x,)])
    check_program(cast)
    assert str(cast.graph) == str(reference.graph)
    for node, other in zip(cast.graph.nodes, reference.graph.nodes):
        assert decision_of(node) == decision_of(other), node.name
    assert cast.state_dict.keys() == reference.state_dict.keys()
    assert {t.dtype for name, t in cast.state_dict.items() if name.startswith("layers")} == {FP16}
    for name, tensor in cast.state_dict.items():
        assert tensor.dtype == reference.state_dict[name].dtype
        assert torch.equal(tensor, reference.state_dict[name]), name
    assert any(meta.range_scaled(node) for node in cast.graph.nodes) or any(
        node.meta.get(meta.SCALE_EXPONENT) for node in cast.graph.nodes
    )
    assert max_error(fp64_reference(wide, x), run(cast, x)) < 16 * 2.0**-11


def test_calibration_runs_the_bf16_weights_as_stored_widening_each_read():
    """Inside the cast's transaction, after the widening: the state is still bf16 (each
    tensor pending fp32), ``graph_inputs(widen=False)`` hands it as stored, and a
    ``LeanInterpreter`` run widens each weight as an op reads it, computing what the
    widened program computes; ``graph_inputs()`` hands it widened."""
    model, x = _bf16_model()
    ep = export(model, x)
    program = Program.of(ep)
    seen = {}

    def calibrate(self, graph_module):
        pending = graph_module.meta[PENDING]
        seen["pending"] = {dtype for dtype, _ in pending.values()}
        seen["stored"] = {t.dtype for t in ep.state_dict.values()}
        lazy = program.graph_inputs((x,), widen=False)
        seen["handed"] = {t.dtype for t in lazy[:-1]}
        seen["lazy"] = LeanInterpreter(graph_module).run(*lazy)
        seen["eager"] = graph_module(*program.graph_inputs((x,)))
        raise RuntimeError("stop here")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CalibrationAnalysis, "call", calibrate)
        with pytest.raises(PassFailedError):
            fx16.cast_to_16_bit_precision(ep, calibration=[(x,)])
    assert seen["pending"] == {FP32} and seen["stored"] == seen["handed"] == {BF16}
    assert torch.equal(seen["lazy"][0], seen["eager"][0])
    with torch.no_grad():
        assert torch.equal(seen["eager"][0], copy.deepcopy(model).float()(x))


def test_a_failed_cast_leaves_the_bf16_state_as_it_was():
    """A stage failing after the widening: the program's state is the same bf16 tensor
    objects, none pending, and the program runs as before."""
    model, x = _bf16_model()
    ep = export(model, x)
    before = dict(ep.state_dict)
    expected = ep.module()(x.to(BF16))

    def fail(self, graph_module):
        raise RuntimeError("a stage fails")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CalibrationAnalysis, "call", fail)
        with pytest.raises(PassFailedError):
            fx16.cast_to_16_bit_precision(ep, calibration=[(x,)])
    assert all(ep.state_dict[name] is tensor for name, tensor in before.items())
    assert PENDING not in ep.graph_module.meta
    assert torch.equal(ep.module()(x.to(BF16)), expected)


def test_weights_the_cast_keeps_fp32_are_widened_at_the_commit():
    """``force_fp32`` on one layer's product in a bf16 program: that layer's weights
    are stored fp32 (widened exactly from bf16 at the commit, then folded by the
    stream's scale), the other layers' fp16, each tensor as the fp32 cast of the same
    weights widened stores it."""
    model, x = _bf16_model()
    options = dict(calibration=[(x,)], force_fp32=["linear_5"])
    cast = fx16.cast_to_16_bit_precision(export(model, x), **options)
    wide = copy.deepcopy(model).float()
    reference = fx16.cast_to_16_bit_precision(export(wide, x), **options)
    check_program(cast)
    for name, tensor in cast.state_dict.items():
        if name.startswith("layers."):
            assert tensor.dtype == (FP32 if name.startswith("layers.5.") else FP16), name
        assert torch.equal(tensor, reference.state_dict[name]), name


def test_a_commit_failing_without_the_callers_tensors_leaves_a_runnable_bf16_program(
    monkeypatch,
):
    """The program holding the only references, the commit converts each bf16 tensor
    over its own memory, and fails on its second: the first, already fp16, comes back
    bf16 from its fp16 bits (exact for the values it holds), so every stored dtype is
    as before and the program runs on bf16 inputs."""
    import gc

    import fx16.program.state_commit

    model, x = _bf16_model()
    ep = export(model, x)
    del model
    gc.collect()
    convert, calls = fx16.program.state_commit.convert_in_place, []

    def fails_second(tensor, *conversion):
        calls.append(tensor.dtype)
        if len(calls) == 2:
            raise MemoryError("no room for the fp16 copy")
        return convert(tensor, *conversion)

    monkeypatch.setattr(fx16.program.state_commit, "convert_in_place", fails_second)
    with pytest.raises(PassFailedError, match="commit"):
        fx16.cast_to_16_bit_precision(ep, calibration=[(x,)])
    assert calls == [BF16, BF16]  # converted from bf16 directly
    assert {t.dtype for t in ep.state_dict.values()} == {BF16}
    assert ep.module()(x.to(BF16)).dtype == BF16


def _plain_bf16_model():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, 8))
    return layers.eval().to(BF16), torch.randn(4, WIDTH)


def test_a_bf16_weight_only_the_program_holds_is_converted_over_its_own_memory():
    """The caller dropped the model: each bf16 weight is made fp16 in its own memory
    (the same storage, no allocation), bit for bit what a copy gives; where the caller
    still holds the model, or a view of one weight, those tensors are copied and the
    caller's keep their bf16 values."""
    import gc

    model, x = _plain_bf16_model()
    held = copy.deepcopy(model)  # the caller keeps this one: its weights are copied
    copied = fx16.cast_to_16_bit_precision(export(held, x), calibration=[(x,)])
    assert all(t.dtype == BF16 for t in held.state_dict().values())
    ep = export(model, x)
    del model
    gc.collect()
    memory = {name: tensor.data_ptr() for name, tensor in ep.state_dict.items()}
    fx16.cast_to_16_bit_precision(ep, calibration=[(x,)])
    check_program(ep)
    assert {t.dtype for t in ep.state_dict.values()} == {FP16}
    for name, tensor in ep.state_dict.items():
        assert torch.equal(tensor, copied.state_dict[name]), name
        assert tensor.data_ptr() == memory[name], name

    model, _ = _plain_bf16_model()  # held by the caller: every weight copied
    before = {name: t.clone() for name, t in model.state_dict().items()}
    cast = fx16.cast_to_16_bit_precision(export(model, x), calibration=[(x,)])
    assert {t.dtype for t in cast.state_dict.values()} == {FP16}
    assert all(torch.equal(t, before[n]) and t.dtype == BF16 for n, t in model.state_dict().items())

    model, _ = _plain_bf16_model()
    viewed = model[0].weight.detach()[:2]  # the caller keeps a view of the first weight only
    seen = viewed.clone()
    ep = export(model, x)
    del model
    gc.collect()
    memory = {name: tensor.data_ptr() for name, tensor in ep.state_dict.items()}
    fx16.cast_to_16_bit_precision(ep, calibration=[(x,)])
    assert torch.equal(viewed, seen) and viewed.dtype == BF16
    moved = {name for name, tensor in ep.state_dict.items() if tensor.data_ptr() != memory[name]}
    assert moved == {"0.weight"}


def _mapped(tensor: torch.Tensor, path, shared: bool) -> nn.Parameter:
    """``tensor``'s bytes written to the file at ``path`` and read back as a tensor of
    its dtype and shape whose storage maps that file (shared: writes reach the file)."""
    raw = tensor.detach().contiguous().view(torch.uint8).reshape(-1)
    path.write_bytes(bytes(raw.tolist()))
    storage = torch.UntypedStorage.from_file(str(path), shared, raw.numel())
    mapped = torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape)
    return nn.Parameter(mapped, requires_grad=False)


def test_a_weight_mapped_shared_from_a_file_is_copied_and_the_file_left_as_it_was(tmp_path):
    """Only the program holds its weights, one of them a file mapped shared (as
    ``torch.load(mmap=True)`` with ``MAP_SHARED`` gives): writing its fp16 bits in place
    would change the checkpoint on disk, so that weight is copied and the file keeps
    its bf16 bytes. A weight mapped privately (copy on write, ``torch.load``'s default)
    is converted in place, in the process's own pages; its file is left as it was too.
    Every weight holds what the copy path gives."""
    import gc

    model, x = _plain_bf16_model()
    copied = fx16.cast_to_16_bit_precision(export(copy.deepcopy(model), x), calibration=[(x,)])
    ep = export(model, x)
    del model
    gc.collect()
    files = {"0.weight": (tmp_path / "shared.bin", True), "2.weight": (tmp_path / "own.bin", False)}
    for name, (path, shared) in files.items():
        ep.state_dict[name] = _mapped(ep.state_dict[name], path, shared)
    written = {path: path.read_bytes() for path, _ in files.values()}
    memory = {name: tensor.data_ptr() for name, tensor in ep.state_dict.items()}
    fx16.cast_to_16_bit_precision(ep, calibration=[(x,)])
    check_program(ep)
    assert all(path.read_bytes() == before for path, before in written.items())
    for name, tensor in ep.state_dict.items():
        assert tensor.dtype == FP16 and torch.equal(tensor, copied.state_dict[name]), name
    moved = {name for name, tensor in ep.state_dict.items() if tensor.data_ptr() != memory[name]}
    assert moved == {"0.weight"}
