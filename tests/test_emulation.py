"""fx16.analysis.emulation: the fp32 program run as the 16-bit cast computes it."""

import math

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from torch import nn

import fx16
from benchmarks import zoo
from fx16.analysis.calibration_inputs import calibration_calls
from fx16.analysis.emulation import Emulation
from fx16.program import Program
from fx16.program.subgraphs import nested_graph_modules
from fx16.testing import programs
from helpers import export, max_error, run
from models import MLP, Branches


def _emulation(ep):
    program = Program(ep)
    return Emulation(program, calibration_calls(program, None), torch.float16)


def _every_node(ep):
    return {n for m in nested_graph_modules(ep.graph_module) for n in m.graph.nodes}


def test_with_everything_wide_it_is_the_fp32_program():
    """Bodies too: a cond's branch is emulated node by node."""
    torch.manual_seed(0)
    for model, x in ((MLP(), torch.randn(4, 8)), (Branches(), torch.randn(2, 4))):
        ep = export(model.eval(), x)
        assert _emulation(ep).error(_every_node(ep)) == 0.0


def test_its_error_is_the_cast_programs():
    """GPT-2: the emulated error is the default cast's, within a factor of two (the cast
    rounds weights, the emulation does not)."""
    torch.manual_seed(0)
    model, ids = zoo.gpt2(layers=2).eval(), torch.randint(0, 1024, (1, 16))
    emulated = _emulation(export(model, ids)).error(set())
    cast = fx16.cast_fp32_to_fp16(export(model, ids))
    with torch.no_grad():
        actual = max_error([model(ids)], run(cast, ids))
    assert 0.5 < emulated / actual < 2.0


class Overflow(nn.Module):
    def forward(self, x):
        return (x * 1e5).sum() * 1e-5


def test_overflow_happens_where_the_cast_has_it():
    """x * 1e5 overflows fp16, and so does its sum: both must be wide (positive inputs:
    the sum of 32 of them cannot cancel below the range)."""
    ep = export(Overflow(), torch.rand(4, 8) + 0.5)
    emulation = _emulation(ep)
    nodes = {n.name: n for n in ep.graph_module.graph.nodes}
    assert emulation.error(set()) == float("inf")
    assert emulation.error({nodes["mul"]}) == float("inf")  # the sum still overflows
    assert emulation.error({nodes["mul"], nodes["sum_1"]}) < 1e-3


class Sentinel(nn.Module):
    """A running maximum that starts at -1e38: exp(-1e38 - x) is 0 in any precision."""

    def forward(self, x):
        state = torch.full_like(x, -1e38)
        best = torch.maximum(state, x)
        return torch.exp(state - best) + best


def test_a_sentinel_saturates_instead_of_becoming_infinite():
    ep = export(Sentinel(), torch.randn(4, 8))
    assert _emulation(ep).error(set()) < 1e-3


def test_it_rounds_to_the_dtype_it_emulates_and_saturates_sentinels():
    """fp16: 1 + 2^-12 rounds to 1, a sentinel saturates to 65504, 7e4 overflows to inf,
    1e-30 flushes to zero; bf16 holds all of them, rounded to its 8 bits."""
    ep = export(Sentinel(), torch.randn(4, 8))
    program = Program(ep)
    calls = calibration_calls(program, None)
    node = next(n for n in ep.graph.nodes if n.op == "call_function")
    x = torch.tensor([1 + 2**-12, 1e38, -3e38, 7e4, 1e-30, -2.5])
    inf = float("inf")
    fp16 = Emulation(program, calls, torch.float16).rounded(node, x)
    assert fp16.dtype == torch.float32
    assert fp16.tolist() == [1.0, 65504.0, -65504.0, inf, 0.0, -2.5]
    bf16 = Emulation(program, calls, torch.bfloat16).rounded(node, (x, 3))
    assert torch.equal(bf16[0], x.bfloat16().float()) and bf16[1] == 3
    assert bf16[0][0] == 1.0 and torch.isfinite(bf16[0]).all()


class WrittenThroughAView(nn.Module):
    """out[:, 0] = x.exp(): a copy_ into a select of a zeros tensor."""

    def forward(self, x):
        out = torch.zeros(x.shape[0], 2)
        out[:, 0] = x.exp().sum(-1)
        return out


def test_a_value_written_through_a_view_arrives():
    ep = export(WrittenThroughAView(), torch.randn(4, 8))
    assert _emulation(ep).error(set()) < 1e-3


@settings(max_examples=examples(10), deadline=None)
@given(programs())
def test_property_with_everything_wide_any_program_is_emulated_exactly(case):
    """Random programs (views written in place, loops, cond, autocast regions): the
    emulator changes nothing it is told to keep, so it runs the fp32 program itself."""
    ep = case.export()
    program = Program(ep)
    calls = calibration_calls(program, [case.args])
    emulation = Emulation(program, calls, torch.float16)
    error = emulation.error(_every_node(ep))
    assert error == 0.0 or math.isnan(error)  # nan: a program whose fp32 output holds nan


class Quantizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.05))

    def forward(self, x):
        codes = torch.ops.fx16_test.quantize(x, self.scale, torch.int8)
        return torch.ops.fx16_test.dequantize(codes, self.scale, torch.float32)


def test_an_op_run_in_low_computes_in_the_16_bit_dtype_whatever_it_returns():
    """The custom quantizer returns int8 and keeps it even where ``wide`` names it:
    ``run_in_low`` runs it on fp16 inputs (0.6748 / 0.04999 is 13.5 in fp16, code 14);
    rounding after it, as the emulation does by default, gives the fp32 code 13."""
    import fx16.testing.custom_ops  # noqa: F401 - registers fx16_test's ops

    x = torch.tensor([[0.6746, 0.3]])
    ep = export(Quantizer(), x)
    program = Program(ep)
    quantize, dequantize = [n for n in ep.graph.nodes if "quantize" in n.name]
    calls = [((x,), {})]
    default = Emulation(program, calls, torch.float16, round_weights=True)
    in_low = Emulation(
        program, calls, torch.float16, round_weights=True, run_in_low=frozenset({quantize})
    )
    (rounded_after,) = default.outputs(calls[0], set())
    (run_in_fp16,) = in_low.outputs(calls[0], {quantize})
    assert rounded_after.dtype == run_in_fp16.dtype == torch.float32
    scale = torch.tensor(0.05).half().float()  # the weights enter rounded

    def dequantized(codes):
        return (torch.tensor([codes]) * scale).half().float()

    assert torch.equal(rounded_after, dequantized([13.0, 6.0]))
    assert torch.equal(run_in_fp16, dequantized([14.0, 6.0]))


class AddOne(nn.Module):
    def forward(self, x):
        return x + 1


def test_a_narrowed_read_rounds_a_wide_value_into_that_reader_only():
    """x and the add kept wide: the add computes from x itself, unless ``narrowed_reads``
    says its read of x is a 16-bit copy (1.0001 rounds to 1 in fp16)."""
    x = torch.tensor([1.0001, 3.0])
    ep = export(AddOne(), x)
    (placeholder,) = [n for n in ep.graph.nodes if n.op == "placeholder"]
    (add,) = [n for n in ep.graph.nodes if n.op == "call_function"]
    program, calls, wide = Program(ep), [((x,), {})], {placeholder, add}
    plain = Emulation(program, calls, torch.float16)
    narrowed = Emulation(
        program, calls, torch.float16, narrowed_reads={add: {placeholder: torch.float16}}
    )
    assert torch.equal(plain.outputs(calls[0], wide)[0], x + 1)
    assert torch.equal(narrowed.outputs(calls[0], wide)[0], x.half().float() + 1)
