"""fx16.analysis.replay: a verdict whose consumers compute the same bits either way needs no run."""

import torch
from fuzz_profile import examples
from hypothesis import given, settings

import fx16
from benchmarks import zoo
from fx16.analysis import Fp32RulesAnalysis, VerdictCheckAnalysis
from fx16.analysis.calibration_inputs import calibration_calls
from fx16.analysis.emulation import Emulation
from fx16.pipelines import fp16_stages, run_passes
from fx16.policy.options import Fp16Options
from fx16.program import Program
from fx16.report import report_of
from fx16.testing import programs
from helpers import check_program, export, gelu_tanh_mlp

IDS = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])


def _checks(ep):
    return ep.graph_module.meta[VerdictCheckAnalysis.CHECKS_KEY]


def _count_runs(monkeypatch) -> list:
    """Count whole emulated runs."""
    runs = []
    error = Emulation.error
    monkeypatch.setattr(Emulation, "error", lambda self, wide: runs.append(1) or error(self, wide))
    return runs


def test_a_cube_read_through_a_cast_is_dropped_without_a_run(monkeypatch):
    """Input: two MLP blocks with GELU's cube written out (``stabilize=False``), which the
    conditioning rule flags; kept fp32, the cube reaches its 16-bit reader through a
    cast, the same bits as a 16-bit cube. Output: one question answered `identical`, no
    whole emulated run, and the same program as when every question is measured."""
    model, x = gelu_tanh_mlp(), torch.randn(8, 64)
    runs = _count_runs(monkeypatch)
    ep = fx16.cast_fp32_to_fp16(export(model, x), stabilize=False)
    check_program(ep)
    (check,) = _checks(ep)
    assert check.label.split()[1] == "pow.Tensor_Scalar" and len(check.nodes) == 2
    assert check.identical and not check.held and not runs
    dropped = [row for row in report_of(ep).rows if row.rule == "not_worth_fp32"]
    assert len(dropped) == 2 and all("changes nothing" in row.detail for row in dropped)

    monkeypatch.setattr(Emulation, "changes_nothing", lambda self, wide, dropped: False)
    measured = fx16.cast_fp32_to_fp16(export(model, x), stabilize=False)
    assert runs  # measured this time
    assert ep.graph_module.code == measured.graph_module.code
    assert [check.held for check in _checks(measured)] == [False]


def test_a_16_bit_reader_reads_a_kept_angle_rounded():
    """Input: Llama's rotary cos and sin, flagged by the conditioning rule. A 16-bit cos
    would read the fp32 angle through a cast (an error of up to half the angle's step),
    so the replay finds a difference; the question is cheap and holds unasked."""
    torch.manual_seed(0)
    ep = fx16.cast_fp32_to_fp16(export(zoo.llama(layers=2), IDS))
    checks = _checks(ep)
    assert {check.label.split()[1] for check in checks} == {"cos.default", "sin.default"}
    assert all(check.cheap and check.held and not check.identical for check in checks)


def test_gpt2s_cube_still_takes_its_runs(monkeypatch):
    """Input: GPT-2 with its GELU written out (``stabilize=False``), whose cube changes the
    values after it. Output: the replay gives up (the difference reaches the outputs),
    and the question is measured."""
    torch.manual_seed(0)
    runs = _count_runs(monkeypatch)
    program = export(zoo.gpt2(layers=2), torch.randint(0, 1024, (1, 16)))
    ep = fx16.cast_fp32_to_fp16(program, stabilize=False)
    (check,) = _checks(ep)
    assert not check.identical and check.error_with is not None and len(runs) == 2


@settings(max_examples=examples(12), deadline=None)
@given(programs())
def test_property_identical_means_the_same_error(case):
    """Random programs: wherever the replay says rounding a kept node changes nothing,
    the whole emulated runs with and without it give exactly the same error."""
    ep = case.export()
    stages = fp16_stages(ep, Fp16Options())
    run_passes([*stages.before_decisions, stages.find(Fp32RulesAnalysis)], ep.graph_module)
    program = Program.of(ep)
    calls = calibration_calls(program, None)
    if not calls:
        return
    check = VerdictCheckAnalysis(program)
    modules = [m for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    wide = check.wide_nodes(modules)
    emulation = Emulation(program, calls, torch.float16)
    for node in sorted(wide, key=lambda n: n.name)[:6]:
        if emulation.changes_nothing(wide, {node}):
            assert emulation.error(wide - {node}) == emulation.error(wide), node.name
