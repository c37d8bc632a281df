"""fx16.testing: another pipeline's pass fuzzed in five lines, and the checks catch a
pass that breaks a program."""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

import fx16
from fx16.testing import ProgramCase, check_cast, check_pass, programs
from fx16.testing.random_programs import VOCAB, RandomProgram

aten = torch.ops.aten


class ReluAsClamp(PassBase):
    """The README's toy pass: relu(x) becomes clamp_min(x, 0)."""

    def call(self, graph_module: GraphModule) -> PassResult:
        modified = False
        for node in graph_module.graph.nodes:
            if node.target == aten.relu.default:
                node.target, node.args = aten.clamp_min.default, (node.args[0], 0.0)
                modified = True
        return PassResult(graph_module, modified)


@settings(max_examples=examples(10), deadline=None)
@given(programs())
def test_the_readme_example_fuzzes_a_pass(case):
    check_pass(case, ReluAsClamp())


class AddBecomesSub(PassBase):
    """A wrong rewrite: integer additions become subtractions."""

    def call(self, graph_module: GraphModule) -> PassResult:
        for node in graph_module.graph.nodes:
            if node.target == aten.add.Tensor and not node.meta["val"].is_floating_point():
                node.target = aten.sub.Tensor
        return PassResult(graph_module, True)


def _case(steps, scale=1.0) -> ProgramCase:
    torch.manual_seed(0)
    model = RandomProgram(4, steps, []).eval()
    args = (torch.randn(3, 4) * scale, torch.randint(0, VOCAB, (3, 4)))
    return ProgramCase(model, args, dynamic=False, decompose=False, input_scale=scale)


def test_a_pass_that_changes_integers_is_caught():
    case = _case([("int_add", 0, 1, 0.0)])
    with pytest.raises(AssertionError, match="integer output"):
        check_pass(case, AddBecomesSub())


def test_a_cast_that_overflows_is_caught():
    """Squares of 300 pass 65504: without calibration nothing shows it, and the fp16
    program gives inf where fp32 is finite; with it, fx16 keeps them fp32."""
    case = _case([("mul", 0, 0, 0.0)], scale=300.0)
    check_cast(case, fx16.cast_fp32_to_fp16)
    with pytest.raises(AssertionError, match="introduced inf/nan"):
        check_cast(case, lambda ep: fx16.cast_fp32_to_fp16(ep, calibration=[]))


def test_a_broken_pass_fails_small_quiet_and_with_the_numbers(capfd, caplog):
    """fuzz_pass on a pass that breaks integer additions: one PassBroke naming a program
    of the one step the failure needs, with expected and actual values, and nothing
    from torch's logs or warnings in the output."""
    caplog.set_level("DEBUG")
    with pytest.raises(fx16.testing.PassBroke) as raised:
        menu = ("abs", "linear", "int_mul", "int_add")  # int additions in most programs
        fx16.testing.fuzz_pass(AddBecomesSub, max_examples=examples(18), strategy=programs(menu))
    message = str(raised.value)
    assert "integer output" in message and "expected" in message and ", got " in message
    assert "on a program of 1 step(s): steps=[('int_" in message
    captured = capfd.readouterr()
    assert "DEBUG" not in captured.out + captured.err
    assert not [r for r in caplog.records if r.name.startswith("torch")]


def test_the_check_shows_the_values_that_differ():
    case = _case([("int_add", 0, 1, 0.0)])
    with pytest.raises(AssertionError, match=r"elements: at \(0, 0\) expected -?\d+, got -?\d+"):
        check_pass(case, AddBecomesSub())
