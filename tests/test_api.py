"""The public entry points: calling convention, PassManager equivalence, errors, transactions."""

import copy

import pytest
import torch
from int16_helpers import int_decisions
from torch.fx.passes.infra.pass_manager import PassManager

import fx16
from fx16.analysis import (
    CalibrationAnalysis,
    ConditioningAnalysis,
    ExplicitFp32Analysis,
    Fp32RulesAnalysis,
    RoutingAnalysis,
    ScaleDomainsAnalysis,
    UnderflowAnalysis,
    UnsafeIndexAnalysis,
    ValueRangeAnalysis,
    VerdictCheckAnalysis,
)
from fx16.passes import (
    CleanupCastsPass,
    ConvertIntInputsPass,
    ConvertParametersPass,
    ConvertUserInputsPass,
    FuseCastChainsPass,
    InsertFP16CastsPass,
    InsertInt16CastsPass,
    PreserveCopiesPass,
    RecastAfterWritesPass,
    RecordStatsPass,
    RemoveNoopCastsPass,
    ScalarsAsConstantsPass,
    ScaleDomainsPass,
    SentinelFillsPass,
    SentinelSumsPass,
    StabilizePass,
    StoreAsReadPass,
    WidenOtherSixteenBitPass,
)
from fx16.pipelines import run_passes
from fx16.policy import PrecisionPolicy
from fx16.program.lazy_code import compile_when_needed
from fx16.report import report_of
from helpers import assert_same_state, check_program, export, run_fx16, state_snapshot
from models import MLP, OverflowWeight, PositionsAndMask, RMSNormMLP

INPUT_WIDTH = {MLP: 8, OverflowWeight: 4, RMSNormMLP: 16}
# OverflowWeight's weight past fp16 on the fp32 path: a scale domain would fold it into
# fp16, and the fp32 reader of its tiny product then needs StoreAsReadPass, which acts
# only inside a cast's transaction (PassManager runs none)
OPTIONS = {OverflowWeight: {"policy": PrecisionPolicy(scale_range=False)}}


def _fresh(model_class, decompose=False):
    """The same program every call: fixed seeds for the weights and the example input."""
    torch.manual_seed(0)
    model = model_class()
    return export(model, torch.randn(3, INPUT_WIDTH[model_class]), decompose=decompose)


def test_cast_works_in_place_and_returns_the_program():
    ep = _fresh(MLP)
    graph_module = ep.graph_module
    assert fx16.cast_fp32_to_fp16(ep) is ep
    assert ep.graph_module is graph_module


@pytest.mark.parametrize("model_class", [MLP, OverflowWeight, RMSNormMLP])
@pytest.mark.parametrize("decompose", [False, True])
def test_pass_manager_gives_the_same_program(model_class, decompose):
    options = OPTIONS.get(model_class, {})
    by_api = fx16.cast_fp32_to_fp16(_fresh(model_class, decompose=decompose), **options)
    by_manager = _fresh(model_class, decompose=decompose)
    PassManager(fx16.fp16_passes(by_manager, **options))(by_manager.graph_module)
    assert_same_state(state_snapshot(by_api), state_snapshot(by_manager))
    for a, b in zip(by_api.example_inputs[0], by_manager.example_inputs[0]):
        assert a.dtype == b.dtype


def test_pass_lists_are_fresh_instances():
    ep = _fresh(MLP)
    first, second = fx16.fp16_passes(ep), fx16.fp16_passes(ep)
    assert [type(p) for p in first] == [type(p) for p in second]
    assert not any(a is b for a, b in zip(first, second))
    assert [type(p) for p in first] == [
        RecordStatsPass,
        WidenOtherSixteenBitPass,
        PreserveCopiesPass,
        StabilizePass,
        CalibrationAnalysis,
        SentinelFillsPass,
        SentinelSumsPass,
        ScaleDomainsAnalysis,
        ScaleDomainsPass,
        UnsafeIndexAnalysis,
        ValueRangeAnalysis,
        ConditioningAnalysis,
        UnderflowAnalysis,
        RoutingAnalysis,
        ExplicitFp32Analysis,
        Fp32RulesAnalysis,
        VerdictCheckAnalysis,
        ConvertParametersPass,
        ConvertUserInputsPass,
        InsertFP16CastsPass,
        StoreAsReadPass,
        RecastAfterWritesPass,
        CleanupCastsPass,
        ScalarsAsConstantsPass,
    ]


@pytest.mark.parametrize("model_class", [MLP, OverflowWeight, RMSNormMLP])
def test_casting_twice_equals_casting_once(model_class):
    ep = fx16.cast_fp32_to_fp16(_fresh(model_class))
    once = state_snapshot(ep)
    assert not run_passes(fx16.fp16_passes(ep), ep.graph_module)
    assert_same_state(once, state_snapshot(ep))


@pytest.mark.parametrize(
    "argument, words",
    [
        (MLP(), "export it first"),
        (torch.fx.symbolic_trace(MLP()), "export it first"),
        (None, "got NoneType"),
        ("model.pt2", "got str"),
    ],
)
def test_wrong_argument_gets_a_clear_error(argument, words):
    for entry in (fx16.cast_fp32_to_fp16, fx16.fp16_passes):
        with pytest.raises(fx16.InvalidProgramError, match=words):
            entry(argument)
    with pytest.raises(TypeError):  # still a TypeError for callers that catch that
        fx16.cast_fp32_to_fp16(argument)


def _fail_after(pass_class, monkeypatch):
    original = pass_class.call

    def failing(self, graph_module):
        original(self, graph_module)  # leave its work half-done, then fail
        raise RuntimeError("injected failure")

    monkeypatch.setattr(pass_class, "call", failing)


@pytest.mark.parametrize(
    "stage",
    [
        ConvertParametersPass,
        ConvertUserInputsPass,
        InsertFP16CastsPass,
        FuseCastChainsPass,
        RemoveNoopCastsPass,
        CleanupCastsPass,
    ],
)
def test_failure_in_any_stage_leaves_the_program_unchanged(stage, monkeypatch):
    ep = _fresh(OverflowWeight)
    before = state_snapshot(ep)
    example_inputs = copy.deepcopy(ep.example_inputs)
    _fail_after(stage, monkeypatch)
    with pytest.raises(fx16.PassFailedError, match="injected failure") as caught:
        fx16.cast_fp32_to_fp16(ep)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert caught.value.stage in (stage.__name__, CleanupCastsPass.__name__)
    assert_same_state(before, state_snapshot(ep))
    assert all(a.dtype == b.dtype for a, b in zip(ep.example_inputs[0], example_inputs[0]))
    monkeypatch.undo()
    fx16.cast_fp32_to_fp16(ep)  # and it can still be cast afterwards
    ep.module()(torch.randn(3, 4).half())


# ---- the combined and int16 entry points ---------------------------------------------


def _int_program():
    args = (torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.bool))
    torch.manual_seed(0)
    model = PositionsAndMask()
    length = torch.export.Dim("length", max=64)
    return export(model, *args, dynamic_shapes=({1: length}, {1: length}))


RANGES = {"ids": (0, 99)}


def test_pass_manager_equals_cast_to_16_bit_precision():
    by_api = fx16.cast_to_16_bit_precision(_int_program(), input_ranges=RANGES)
    by_manager = _int_program()
    passes = fx16.fp16_passes(by_manager, target="neural_engine")
    passes += fx16.int16_passes(by_manager, input_ranges=RANGES)
    PassManager(passes)(by_manager.graph_module)
    assert_same_state(state_snapshot(by_api), state_snapshot(by_manager))


def test_combined_cast_converts_both_and_is_idempotent():
    ep = fx16.cast_to_16_bit_precision(_int_program(), input_ranges=RANGES)
    check_program(ep)
    assert ep.state_dict["embed.weight"].dtype == torch.float16
    assert any(d.dtype == torch.int16 for d in int_decisions(ep).values())
    once = state_snapshot(ep)
    passes = fx16.fp16_passes(ep) + fx16.int16_passes(ep, input_ranges=RANGES)
    assert not run_passes(passes, ep.graph_module)
    assert_same_state(once, state_snapshot(ep))


@pytest.mark.parametrize("int16", ["proven", "observed"])
def test_combined_cast_marks_the_code_stale_once_after_both_stages(int16, monkeypatch):
    """The cast generates no code for the root: it marks it stale once, after both
    stages, and reading it generates it once, from the final graph."""
    ep = _int_program()
    marked, compiled = [], []
    recompile = torch.fx.GraphModule.recompile

    def counted(graph_module):
        compiled.append(graph_module)
        return recompile(graph_module)

    def counted_marks(graph_module):
        marked.append(graph_module)
        compile_when_needed(graph_module)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    monkeypatch.setattr(fx16.pipelines, "compile_when_needed", counted_marks)
    fx16.cast_to_16_bit_precision(ep, input_ranges=RANGES, int16=int16)
    assert marked == [ep.graph_module] and compiled == []
    assert ep.graph_module.code == ep.graph_module.graph.python_code("self").src
    assert compiled == [ep.graph_module]
    assert any(d.dtype == torch.int16 for d in int_decisions(ep).values())
    check_program(ep)


def test_int16_off_only_casts_floats():
    ep = fx16.cast_to_16_bit_precision(_int_program(), int16="off")
    assert int_decisions(ep) == {}
    assert fx16.int16_passes(ep, int16="off") == []


@pytest.mark.parametrize("stage", [InsertInt16CastsPass, ConvertIntInputsPass, CleanupCastsPass])
def test_failure_in_an_int16_stage_restores_the_program(stage, monkeypatch):
    ep = _int_program()
    before = state_snapshot(ep)
    _fail_after(stage, monkeypatch)
    with pytest.raises(fx16.PassFailedError, match="injected failure"):
        fx16.cast_to_16_bit_precision(ep, input_ranges=RANGES)
    assert_same_state(before, state_snapshot(ep))
    assert ep.example_inputs[0][0].dtype == torch.int64


def test_bad_input_range_name_leaves_the_program_unchanged():
    ep = _int_program()
    before = state_snapshot(ep)
    with pytest.raises(fx16.InvalidOptionError, match="input_ids"):
        fx16.cast_to_16_bit_precision(ep, input_ranges={"input_ids": (0, 9)})
    assert_same_state(before, state_snapshot(ep))


def test_unknown_option_is_named():
    with pytest.raises(fx16.InvalidOptionError, match="input_range'.*accepted"):
        fx16.cast_to_16_bit_precision(_int_program(), input_range={"ids": (0, 9)})


def test_the_three_functions_take_coreai_opts_parameters():
    """coreai-opt 0.3.0: ``cast_fp32_to_fp16(exported_program, ignored_ops=None)``,
    ``cast_to_16_bit_precision(exported_program, ignored_ops=None)``,
    ``cast_int32_to_int16(exported_program)``: the same names, positions and defaults
    (fx16's own options come after, by keyword)."""
    import inspect

    expected = {
        "cast_fp32_to_fp16": ["exported_program", "ignored_ops"],
        "cast_to_16_bit_precision": ["exported_program", "ignored_ops"],
        "cast_int32_to_int16": ["exported_program"],
    }
    for name, names in expected.items():
        parameters = list(inspect.signature(getattr(fx16, name)).parameters.values())
        positional = [p for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
        assert [p.name for p in positional] == names
        assert all(p.default is None for p in positional[1:])
    torch.manual_seed(0)
    for function in (
        fx16.cast_fp32_to_fp16,
        fx16.cast_to_16_bit_precision,
        fx16.cast_int32_to_int16,
    ):
        assert function(exported_program=_fresh(MLP)) is not None


class TwoExps(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.exp(self.linear(x).tanh()) + torch.exp(-x.abs())


@pytest.mark.parametrize(
    ("ignored", "kept"),
    [
        ({torch.ops.aten.exp}, {"exp", "exp_1"}),  # a packet: every overload
        (torch.ops.aten.exp.default, {"exp", "exp_1"}),  # one op, not in a collection
        ([torch.ops.aten.exp.default], {"exp", "exp_1"}),
        (lambda node: node.name == "exp_1", {"exp_1"}),  # a predicate on a node
    ],
    ids=["packet", "overload", "list", "predicate"],
)
def test_ignored_ops_keeps_what_it_names_fp32_with_its_own_cause(ignored, kept):
    """As coreai-opt: the named ops compute in fp32 with casts at their boundary; the
    report says ``ignored_op`` ("the caller's ignored_ops names it"), not force_fp32."""
    x = torch.randn(4, 8)
    for function in (fx16.cast_fp32_to_fp16, fx16.cast_to_16_bit_precision):
        ep = function(export(TwoExps().eval(), x), ignored)  # positional, as coreai-opt
        check_program(ep)
        rows = {row.node: row for row in report_of(ep).rows}
        assert {name for name in ("exp", "exp_1") if rows[name].rule == "ignored_op"} == kept
        assert all(rows[name].dtype == "float32" for name in kept)
        assert rows["linear"].dtype == "float16"


@pytest.mark.parametrize("bad", ["exp", ["exp"], 3, [torch.ops.aten.exp, "exp"]])
def test_a_malformed_ignored_ops_is_refused_and_changes_nothing(bad):
    ep = export(TwoExps().eval(), torch.randn(4, 8))
    before = ep.graph_module.code
    with pytest.raises(fx16.InvalidOptionError, match="ignored_ops takes an op"):
        fx16.cast_fp32_to_fp16(ep, ignored_ops=bad)
    assert ep.graph_module.code == before


def test_the_command_line_takes_ignore_op(tmp_path):
    source = tmp_path / "exps.pt2"
    torch.export.save(export(TwoExps().eval(), torch.randn(4, 8)), source)
    result = run_fx16(["inspect", source, "--ignore-op", "exp", "--ignore-op", "aten.tanh.default"])
    assert result.returncode == 0, result.stderr
    kept = {line.split()[0] for line in result.stdout.splitlines() if " ignored_op " in line}
    assert kept == {"exp", "exp_1", "tanh"}
    bad = run_fx16(["inspect", source, "--ignore-op", "no_such_op"])
    assert bad.returncode == 2 and "--ignore-op no_such_op: no such op" in bad.stderr
