"""A catalogue of unusual and bad inputs: each gets the exact error type and message, or
is cast as documented; an error always leaves the caller's program as it was."""

import re

import pytest
import torch

import fx16
from fx16.report import report_of
from fx16.testing.custom_ops import QuantizedLinear, UserOps
from helpers import assert_same_state, check_program, export, state_snapshot
from models import MLP, BufferUpdate, MixedBuffers

ENTRY_POINTS = [fx16.cast_fp32_to_fp16, fx16.cast_int32_to_int16, fx16.cast_to_16_bit_precision]


def _raises(error_type, message, call, *args, **kwargs):
    """``call`` raises exactly ``error_type`` with exactly ``message``."""
    with pytest.raises(error_type, match=f"^{re.escape(message)}$"):
        call(*args, **kwargs)


# ---- not a program -------------------------------------------------------------------


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_module_is_not_a_program(entry):
    _raises(
        fx16.InvalidProgramError,
        "fx16 expects a torch.export.ExportedProgram, got MLP; "
        "export it first with torch.export.export(model, args)",
        entry,
        MLP(),
    )


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_bare_graph_module_is_not_a_program(entry):
    _raises(
        fx16.InvalidProgramError,
        "fx16 expects a torch.export.ExportedProgram, got a torch.fx.GraphModule (MLP) "
        "without export metadata; export it first with torch.export.export(model, args)",
        entry,
        torch.fx.symbolic_trace(MLP()),
    )


@pytest.mark.parametrize("argument, name", [(None, "NoneType"), ("model.pt2", "str")])
def test_other_objects_are_named(argument, name):
    _raises(
        fx16.InvalidProgramError,
        f"fx16 expects a torch.export.ExportedProgram, got {name}",
        fx16.cast_to_16_bit_precision,
        argument,
    )


# ---- programs with nothing (or nothing more) to cast -----------------------------------


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


class IntegersOnly(torch.nn.Module):
    def forward(self, a, b):
        return a * b + 1


class Dequantize(torch.nn.Module):
    """An int8 weight with an fp32 scale, dequantized in the graph."""

    def __init__(self):
        super().__init__()
        self.register_buffer("qweight", torch.randint(-127, 128, (4, 4), dtype=torch.int8))
        self.register_buffer("scale", torch.tensor(0.05))

    def forward(self, x):
        return x @ (self.qweight.float() * self.scale)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_empty_graph_is_returned_as_it_was(entry):
    ep = export(Identity(), torch.randn(2, 3))
    code = ep.graph_module.code
    entry(ep)
    assert ep.graph_module.code == code
    totals = fx16.report.report_of(ep).totals
    assert (totals.float_ops, totals.casts_inserted) == (0, 0)


def test_a_program_without_floats_gets_only_the_int16_stage():
    ep = export(IntegersOnly(), torch.arange(4), torch.arange(4))
    before = state_snapshot(ep)
    fx16.cast_fp32_to_fp16(ep)
    assert_same_state(before, state_snapshot(ep))
    fx16.cast_to_16_bit_precision(ep, input_ranges={"a": (0, 9), "b": (0, 9)})
    check_program(ep)
    assert ep.example_inputs[0][0].dtype == torch.int16


def test_an_fp16_program_is_refused_and_left_as_it_is():
    """Nothing to cast: said (once a silent no-op), and the program is unchanged."""
    model = MLP().half()
    ep = export(model, torch.randn(3, 8).half())
    before = state_snapshot(ep)
    with pytest.raises(fx16.InvalidProgramError, match="computes in float16 already"):
        fx16.cast_to_16_bit_precision(ep)
    assert_same_state(before, state_snapshot(ep))


def test_int8_weights_stay_untouched():
    ep = export(Dequantize(), torch.randn(2, 4))
    qweight = ep.state_dict["qweight"].clone()
    fx16.cast_to_16_bit_precision(ep)
    check_program(ep)
    assert torch.equal(ep.state_dict["qweight"], qweight)
    assert ep.state_dict["scale"].dtype == torch.float16


def test_mixed_buffers_keep_their_own_dtypes():
    ep = export(MixedBuffers(), torch.randn(2, 8))
    dtypes = {k: v.dtype for k, v in ep.state_dict.items() if v.dtype != torch.float32}
    assert set(dtypes.values()) == {torch.float16, torch.int8, torch.float64}
    fx16.cast_to_16_bit_precision(ep)
    check_program(ep)
    assert {k: ep.state_dict[k].dtype for k in dtypes} == dtypes


@pytest.mark.parametrize("decompose", [False, True], ids=["training IR", "ATen dialect"])
def test_buffer_mutations_in_both_dialects(decompose):
    ep = export(BufferUpdate(accumulate=False), torch.randn(3, 4), decompose=decompose)
    kinds = {spec.kind.name for spec in ep.graph_signature.output_specs}
    assert ("BUFFER_MUTATION" in kinds) == decompose
    fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    assert ep.state_dict["running"].dtype == torch.float16


# ---- compressed programs and custom ops --------------------------------------------------


@pytest.mark.parametrize("decompose", [False, True], ids=["training IR", "ATen dialect"])
def test_custom_quantization_ops_are_cast_with_their_real_dtypes(decompose):
    """dequantize(int8, scale, output_dtype=float32) computes in its scale's dtype: fp16
    once the scale is, which the program records; the int8 weight is untouched."""
    ep = export(QuantizedLinear(), torch.randn(3, 8), decompose=decompose)
    qweight = ep.state_dict["qweight"].clone()
    fx16.cast_to_16_bit_precision(ep)
    check_program(ep)
    assert torch.equal(ep.state_dict["qweight"], qweight)


def test_a_custom_op_refusing_16_bit_is_a_decision_not_an_error():
    ep = export(UserOps(), torch.randn(3, 8))
    fx16.cast_to_16_bit_precision(ep)
    check_program(ep)
    rules = {row.rule for row in report_of(ep).rows}
    assert {"no_fake_kernel", "fixed_output_dtype"} <= rules


def test_a_torchao_subclass_weight_is_cast_not_a_crash():
    """torchao's Int8Tensor has no aminmax: fx16 reads its inner tensors instead."""
    pytest.importorskip("torchao")
    from benchmarks.compression import compressed_program

    ep, example = compressed_program("torchao int8 weight-only", "gated MLP")
    reference = ep.module()(example)
    fx16.cast_to_16_bit_precision(ep)
    check_program(ep)
    torch.testing.assert_close(ep.module()(example.half()).float(), reference, atol=2e-2, rtol=0)


# ---- options -------------------------------------------------------------------------


@pytest.fixture
def mlp():
    return export(MLP(), torch.randn(3, 8))


OPTION_ERRORS = [
    (
        fx16.cast_fp32_to_fp16,
        dict(policy="fastest"),
        "unknown policy 'fastest'; presets: default, always_fp32, always_fp16, auto_mixed, "
        "auto_mixed_conservative, auto_mixed_bf16, autocast",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(policy=3),
        "policy must be a PrecisionPolicy or a preset name, not int",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(max_rel_error=-1),
        "max_rel_error must be a number >= 0, got -1",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(max_rel_error=1e-3, calibration=[]),
        "max_rel_error needs inputs to measure on: pass calibration=[(args...), ...] "
        "(calibration=[] gives none)",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(calibration=torch.randn(3, 8)),
        "calibration must be a list of argument tuples, got Tensor",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(calibration=[(torch.randn(3, 8), torch.randn(3, 8))]),
        "calibration[0] passes 2 positional arguments; the program takes 1 (x)",
    ),
    (
        fx16.cast_int32_to_int16,
        dict(int16="maybe"),
        "int16='maybe' is not one of off, proven, observed, assume_safe",
    ),
    (
        fx16.cast_int32_to_int16,
        dict(input_ranges={"ids": (0, 9)}),
        "input_ranges names ['ids'], which are not user inputs; the program's user inputs "
        "are ['x']",
    ),
    (
        fx16.cast_int32_to_int16,
        dict(input_ranges={"x": (5, 1)}),
        "input_ranges['x'] must be (low, high) integers with low <= high, got (5, 1)",
    ),
    (
        fx16.cast_to_16_bit_precision,
        dict(int16="off", input_ranges={"x": (0, 1)}),
        "input_ranges['x']: 'x' is a float input (float32); input_ranges declares integer "
        "inputs' ranges",
    ),
    (
        fx16.cast_to_16_bit_precision,
        dict(input_range={"x": (0, 1)}),
        "cast_to_16_bit_precision: unknown option(s) ['input_range']; accepted: "
        "['calibration', 'eps_clamp', 'explicit_fp32', 'force_fp32', 'input_ranges', "
        "'int16', 'keep_io_types', 'max_rel_error', 'metric', 'overflow_margin', 'policy', "
        "'progress', 'range_fallback', 'routing', 'scalars', 'stabilize', 'target', "
        "'target_share', 'validation']",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(calibration=[(torch.randn(5, 8),)]),
        "calibration[0]: input 'x' has shape (5, 8); the program takes (3, 8)",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(calibration=[(torch.randn(3, 7),)], max_rel_error=1e-2),
        "calibration[0]: input 'x' has shape (3, 7); the program takes (3, 8)",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(calibration=[(torch.ones(3, 8, dtype=torch.int64),)]),
        "calibration[0]: input 'x' is integer (int64); the program takes floating point (float32)",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(calibration=[(torch.full((3, 8), float("nan")),)]),
        "calibration[0]: input 'x' holds no finite value (all inf or NaN): it measures nothing",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(stabilize="yes"),
        "stabilize must be True, False or None, got 'yes'",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(progress="yes"),
        "progress must be True, False or None, got 'yes'",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(routing="bf16"),
        "routing must be one of 'fp32', '16-bit', not 'bf16'",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(overflow_margin=0),
        "overflow_margin must be a number >= 1, got 0",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(overflow_margin=0.5),
        "overflow_margin must be a number >= 1, got 0.5",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(keep_io=True),
        "cast_fp32_to_fp16: unknown option(s) ['keep_io']; accepted: ['calibration', "
        "'eps_clamp', 'explicit_fp32', 'force_fp32', 'input_ranges', 'keep_io_types', "
        "'max_rel_error', 'metric', 'overflow_margin', 'policy', 'progress', 'range_fallback', "
        "'routing', 'scalars', 'stabilize', 'target', 'target_share', 'validation']",
    ),
    (
        fx16.cast_int32_to_int16,
        dict(ranges={"x": (0, 1)}),
        "cast_int32_to_int16: unknown option(s) ['ranges']; accepted: ['calibration', "
        "'input_ranges', 'int16']",
    ),
    (
        fx16.fp16_passes,
        dict(margin=2),
        "fp16_passes: unknown option(s) ['margin']; accepted: ['calibration', "
        "'eps_clamp', 'explicit_fp32', 'force_fp32', 'ignored_ops', 'input_ranges', "
        "'keep_io_types', 'overflow_margin', 'policy', 'range_fallback', 'routing', "
        "'scalars', 'stabilize', 'target']",
    ),
    (
        fx16.int16_passes,
        dict(mode="proven"),
        "int16_passes: unknown option(s) ['mode']; accepted: ['calibration', 'input_ranges', "
        "'int16']",
    ),
    (
        fx16.cast_fp32_to_fp16,
        dict(policy=fx16.PrecisionPolicy.auto_mixed(keep_io_types=True), explicit_fp32="often"),
        "explicit_fp32 must be one of 'calibrated', 'keep', 'retarget', not 'often'",
    ),
]


@pytest.mark.parametrize(
    "entry, options, message", OPTION_ERRORS, ids=[m.split(" ")[0] for *_, m in OPTION_ERRORS]
)
def test_bad_options_are_named_and_change_nothing(mlp, entry, options, message):
    before = state_snapshot(mlp)
    _raises(fx16.InvalidOptionError, message, entry, mlp, **options)
    assert_same_state(before, state_snapshot(mlp))


def test_a_single_tensor_is_one_calibration_input(mlp):
    fx16.cast_fp32_to_fp16(mlp, calibration=[torch.randn(3, 8), torch.randn(3, 8)])
    assert mlp.graph_module.meta["fx16.calibration"] == "observed on 2 input(s)"


def test_keep_io_types_is_a_keyword_of_the_cast_functions(mlp):
    """onnxconverter-common's option: inputs and outputs keep fp32, the rest is 16-bit."""
    x = torch.randn(3, 8)
    fx16.cast_fp32_to_fp16(mlp, keep_io_types=True)
    check_program(mlp)
    assert mlp.module()(x).dtype == torch.float32
    assert {t.dtype for t in mlp.state_dict.values()} == {torch.float16}


def test_presets_take_overrides_of_any_field():
    policy = fx16.PrecisionPolicy.auto_mixed(keep_io_types=True)
    assert policy.name == "auto_mixed" and policy.keep_io_types is True
    bf16 = fx16.PrecisionPolicy.autocast("cpu", explicit_fp32="retarget")
    assert bf16.explicit_fp32 == "retarget" and bf16.low == torch.bfloat16
    _raises(
        fx16.InvalidOptionError,
        "unknown policy field(s) ['keep_io']; fields: name, low, kinds, ops, modules, nodes, "
        "predicate, op_table, keep_io_types, explicit_fp32, routing, cast_back, "
        "widen_model_16bit, precision_tolerance, stabilize, eps_clamp, scale_range, "
        "range_fallback",
        fx16.PrecisionPolicy.default,
        keep_io=True,
    )


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("max_rel_error", float("inf"), "max_rel_error must be a finite number >= 0, got inf"),
        ("max_rel_error", True, "max_rel_error must be a number >= 0, got True"),
        ("overflow_margin", float("nan"), "overflow_margin must be a number >= 1, got nan"),
        ("overflow_margin", "2", "overflow_margin must be a number >= 1, got '2'"),
    ],
)
def test_numbers_are_real_finite_numbers_in_range(mlp, option, value, message):
    before = state_snapshot(mlp)
    _raises(fx16.InvalidOptionError, message, fx16.cast_fp32_to_fp16, mlp, **{option: value})
    assert_same_state(before, state_snapshot(mlp))


def test_precision_tolerance_is_positive_and_may_be_infinite():
    _raises(
        fx16.InvalidOptionError,
        "precision_tolerance must be a number > 0 (or None), got 0",
        fx16.PrecisionPolicy.custom,
        precision_tolerance=0,
    )
    assert fx16.PrecisionPolicy.custom(precision_tolerance=float("inf")).precision_tolerance


def test_calibration_outside_the_dynamic_range_is_refused_and_changes_nothing():
    """Exported for batch 2..64: batch 100 is refused by the cast and by inputs_for, as the
    fp32 program refuses it; the program is left as it was, and casts afterwards."""
    from torch.export import Dim

    ep = torch.export.export(
        MLP().eval(), (torch.randn(4, 8),), dynamic_shapes=({0: Dim("b", min=2, max=64)},)
    )
    before = state_snapshot(ep)
    message = (
        "input 'x' has shape (100, 8); the program takes (2..64, 8) (a..b: any size from a to b)"
    )
    _raises(
        fx16.InvalidOptionError,
        f"calibration[0]: {message}",
        fx16.cast_fp32_to_fp16,
        ep,
        calibration=[(torch.randn(100, 8),)],
    )
    _raises(
        fx16.InvalidOptionError,
        f"inputs_for[0]: {message}",
        fx16.inputs_for,
        ep,
        torch.randn(100, 8),
    )
    assert_same_state(before, state_snapshot(ep))
    fx16.cast_fp32_to_fp16(ep)
    args, kwargs = fx16.inputs_for(ep, torch.randn(64, 8))
    assert ep.module()(*args, **kwargs).dtype == torch.float16


def test_inputs_for_refuses_what_is_not_a_tensor(mlp):
    import numpy as np

    _raises(
        fx16.InvalidOptionError,
        "inputs_for[0]: input 'x' is a numpy.ndarray; the program takes a torch.Tensor "
        "(convert it with torch.from_numpy)",
        fx16.inputs_for,
        mlp,
        np.zeros((3, 8), dtype=np.float32),
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (
            ([[1.0] * 8] * 3,),
            {},
            "passes a nested list for input 'x'; the program takes a torch.Tensor there "
            "(convert it with torch.tensor)",
        ),
        (
            (),
            {"x": torch.randn(3, 8), "y": torch.randn(3, 8)},
            "passes unknown keyword(s) 'y'; the program's inputs: x",
        ),
    ],
)
def test_inputs_for_names_the_input_and_the_problem(mlp, args, kwargs, message):
    """A nested list where the program takes a tensor, or a keyword it has no input of,
    was once told as "supplies 24 input value(s); the program takes 1"."""
    _raises(
        fx16.InvalidOptionError, f"inputs_for[0] {message}", fx16.inputs_for, mlp, *args, **kwargs
    )


def test_routing_is_a_keyword_option(mlp):
    fx16.cast_fp32_to_fp16(mlp, routing="16-bit")
    assert fx16.report.report_of(mlp).provenance["options"]["routing"] == "16-bit"


def test_input_ranges_on_a_float_input_are_refused(mlp):
    before = state_snapshot(mlp)
    _raises(
        fx16.InvalidOptionError,
        "input_ranges['x']: 'x' is a float input (float32); input_ranges declares integer "
        "inputs' ranges",
        fx16.cast_to_16_bit_precision,
        mlp,
        input_ranges={"x": (0, 1)},
    )
    assert_same_state(before, state_snapshot(mlp))


def test_input_ranges_have_no_effect_without_int16():
    from fx16.program import Program
    from models import EmbeddingNormSoftmax

    ids = torch.randint(0, 10, (2, 4))
    ep = export(EmbeddingNormSoftmax(), ids)
    before = state_snapshot(ep)
    name = Program(ep).user_input_placeholders()[0].name
    _raises(
        fx16.InvalidOptionError,
        "input_ranges has no effect with int16='off'; drop one",
        fx16.cast_to_16_bit_precision,
        ep,
        int16="off",
        input_ranges={name: (0, 9)},
    )
    assert_same_state(before, state_snapshot(ep))
