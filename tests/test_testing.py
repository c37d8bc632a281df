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


class MulToAdd(PassBase):
    """A wrong rewrite that keeps every dtype: float multiplies become additions."""

    def call(self, graph_module: GraphModule) -> PassResult:
        modified = False
        for node in graph_module.graph.nodes:
            if node.target == aten.mul.Tensor and node.meta["val"].is_floating_point():
                node.target = aten.add.Tensor
                modified = True
        return PassResult(graph_module, modified)


class AddWithoutMeta(PassBase):
    """A broken pass: it adds a node and gives it no ``meta["val"]``."""

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        output = graph.output_node()
        (first, *rest) = output.args[0]
        with graph.inserting_before(output):
            doubled = graph.call_function(aten.mul.Tensor, (first, 1.0))
        output.args = ((doubled, *rest),)
        return PassResult(graph_module, True)


class HalfBeforeLinear(PassBase):
    """Returns normally, but leaves a program that cannot run: a linear's input is cast
    to fp16 while its weight stays fp32."""

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        for node in list(graph.nodes):
            if node.target == aten.linear.default:
                with graph.inserting_before(node):
                    half = graph.call_function(
                        aten._to_copy.default, (node.args[0],), {"dtype": torch.float16}
                    )
                half.meta["val"] = node.args[0].meta["val"].half()
                node.replace_input_with(node.args[0], half)
                return PassResult(graph_module, True)
        return PassResult(graph_module, False)


def test_a_rewritten_program_that_fails_to_run_is_told_apart_from_a_pass_that_raises():
    """Input graph: linear(x, w). Output graph: linear(x.half(), w): the pass returns,
    the program it leaves raises when run. check_pass says so in an AssertionError (once
    torch's RuntimeError leaked), and fuzz_pass does not blame the pass for raising."""
    case = _case([("linear", 0, 0, 0.0)])
    with pytest.raises(AssertionError, match="^the rewritten program fails when run: Runtime"):
        check_pass(case, HalfBeforeLinear())
    with pytest.raises(fx16.testing.PassBroke, match="the rewritten program fails when run"):
        fx16.testing.fuzz_pass(
            HalfBeforeLinear, max_examples=examples(5), strategy=programs(("linear",))
        )


class GeluToRelu(PassBase):
    """A wrong rewrite of one op family into another: gelu becomes relu."""

    def call(self, graph_module: GraphModule) -> PassResult:
        modified = False
        for node in graph_module.graph.nodes:
            if node.target == aten.gelu.default:
                node.target, node.args, node.kwargs = aten.relu.default, node.args[:1], {}
                modified = True
        return PassResult(graph_module, modified)


@pytest.mark.parametrize("seed", [1, 2])
def test_default_settings_catch_a_pass_that_replaces_one_op_family(seed):
    """With hypothesis seeds 1 and 2, fuzz_pass once drew no program holding a gelu in
    50 and passed GeluToRelu; the sweep over the whole menu finds the op it touches."""
    with pytest.raises(fx16.testing.PassBroke, match=r"steps=\[\('gelu'"):
        fx16.testing.fuzz_pass(GeluToRelu, seed=seed)


class GeluToReluDeclared(GeluToRelu):
    touches = ("gelu",)


def test_a_pass_that_declares_what_it_touches_is_fuzzed_there(monkeypatch):
    """No sweep: half the random programs are drawn from the declared entries."""
    import fx16.testing.fuzz as fuzz

    monkeypatch.setattr(fuzz, "sweep_cases", lambda: pytest.fail("swept"))
    with pytest.raises(fx16.testing.PassBroke, match="gelu"):
        fx16.testing.fuzz_pass(GeluToReluDeclared, seed=1)


def test_a_seed_makes_the_draw_reproducible(monkeypatch):
    """Two runs with one seed check the same programs, step for step."""
    import fx16.testing.fuzz as fuzz

    seen: list[list] = []
    monkeypatch.setattr(fuzz, "failure", lambda case, *_: seen[-1].append(case.model.steps))
    for _ in range(2):
        seen.append([])
        fx16.testing.fuzz_pass(ReluAsClamp, max_examples=5, seed=7, touches=("relu",))
    assert len(seen[0]) == 5 and seen[0] == seen[1]


def test_the_sweep_holds_every_menu_entry_in_programs_that_export():
    from fx16.testing.random_programs import MENU
    from fx16.testing.strategies import sweep_cases

    cases = sweep_cases()
    assert {step[0] for case in cases for step in case.model.steps} == set(MENU)
    for case in cases:
        case.export()


def test_a_pass_that_computes_wrong_floats_is_caught():
    """fuzz_pass(MulToAdd) on a float-only menu: a PassBroke naming the float output
    that is off, with the values."""
    with pytest.raises(fx16.testing.PassBroke, match=r"float output \d+ is .* off the original"):
        fx16.testing.fuzz_pass(
            MulToAdd, max_examples=examples(15), strategy=programs(menu=("mul",))
        )


def test_a_pass_that_leaves_an_invalid_program_is_a_pass_broke():
    """A node without meta["val"] is reported as PassBroke, not a raw SpecViolationError."""
    with pytest.raises(fx16.testing.PassBroke, match="not a valid program"):
        fx16.testing.fuzz_pass(
            AddWithoutMeta, max_examples=examples(5), strategy=programs(menu=("add",))
        )


def test_a_cast_that_computes_wrong_floats_is_caught_though_rules_kept_fp32():
    """A cast whose result is off: fx16's cast with its multiplies made additions
    afterwards fails the emulated bound, on a program where a rule keeps fp32 (the
    squares of 300 pass 65504)."""
    case = _case([("mul", 0, 0, 0.0), ("mul", 1, 0, 0.0)], scale=300.0)
    check_cast(case, fx16.cast_fp32_to_fp16)
    _assert_caught_when_broken(case, fx16.cast_fp32_to_fp16, MulToAdd())


def _assert_caught_when_broken(case, cast, breaking_pass) -> None:
    """``cast``, then ``breaking_pass`` run on its program, fails the float oracle."""

    def cast_then_break(ep):
        cast(ep)
        breaking_pass(ep.graph_module)
        ep.graph_module.recompile()

    with pytest.raises(AssertionError, match="float output"):
        check_cast(case, cast_then_break)


class AddBecomesSubAfterDequantize(PassBase):
    """Breaks a cast: the float add after the dequantize becomes a subtraction."""

    def call(self, graph_module: GraphModule) -> PassResult:
        for node in graph_module.graph.nodes:
            if node.target == aten.add.Tensor and "dequantize" in str(node.args[0]):
                node.target = aten.sub.Tensor
                return PassResult(graph_module, True)
        return PassResult(graph_module, False)


def test_a_custom_quantizer_fed_16_bit_is_emulated_as_its_kernel_computes():
    """A custom quantizer computes in its inputs' dtype: in fp16, 0.6748 / 0.04999 rounds
    to 13.5 before it rounds to the code 14 (fp32: 13.4993 -> 13), a whole step of the
    scale. The oracle runs the custom ops the cast feeds 16-bit in 16-bit (found by the
    long fuzz: rounding only their results held the cast to the fp32 code, 0.0136 off
    against a bound of 0.011); a cast broken after the quantizer is still caught."""
    torch.manual_seed(0)
    model = RandomProgram(5, [("quantize_dequantize", 0, 0, 0.0)], []).eval()
    x = torch.tensor([[1.6108, 0.6746, -0.7696, -0.4025, 1.2595]])
    case = ProgramCase(model, (x, torch.zeros(1, 5, dtype=torch.long)), False, False, 1.0)
    fp16_quotient = (x.half() / model.act_scale.half())[0, 1]
    assert fp16_quotient == 13.5 and (x / model.act_scale)[0, 1] < 13.5  # the boundary case
    ep = check_cast(case, fx16.cast_fp32_to_fp16)
    assert {n.meta["val"].dtype for n in ep.graph.nodes if "quantize" in n.name} == {
        torch.int8,
        torch.float16,
    }
    _assert_caught_when_broken(case, fx16.cast_fp32_to_fp16, AddBecomesSubAfterDequantize())


class AbsBecomesNeg(PassBase):
    """Breaks a cast: the first abs becomes a negation."""

    def call(self, graph_module: GraphModule) -> PassResult:
        for node in graph_module.graph.nodes:
            if node.target == aten.abs.default:
                node.target = aten.neg.default
                return PassResult(graph_module, True)
        return PassResult(graph_module, False)


def test_a_value_kept_fp32_for_one_reader_is_rounded_into_the_reader_fed_a_16_bit_copy():
    """``sin(x) + cos(mean(x xT))`` with x near 1000, ``always_fp16``: x stays fp32 for
    the sin (ill-conditioned), while the product reads a 16-bit copy of x (the
    conditioning marks stop before a product), and cos of its 1e6-sized mean is another
    number (found by the long fuzz: 0.635 off against a bound of 0.011, the emulation
    having fed the product x itself). The oracle rounds x into the product as the cast
    does (which makes that output's bound as loose as 16-bit makes it); a cast broken
    elsewhere is still caught."""
    steps = [("matmul", 0, 0, 0.0)] + [("abs", 0, 0, 0.0)] * 6 + [("sin", 0, 1, 0.0)]
    torch.manual_seed(0)
    model = RandomProgram(2, steps, []).eval()
    x = torch.tensor([[657.7076, 938.6567], [1131.7307, -645.4730], [-1770.2916, 214.2729]])
    ids = torch.tensor([[9, 10], [10, 15], [8, 1]])
    case = ProgramCase(model, (x, ids), False, False, 1000.0)

    def cast(ep):
        fx16.cast_to_16_bit_precision(ep, policy="always_fp16", input_ranges=case.input_ranges)

    ep = check_cast(case, cast)
    x_read = {n.name: n.args[0] for n in ep.graph.nodes if n.name in ("sin", "unsqueeze")}
    assert x_read["sin"].meta["val"].dtype == torch.float32
    assert x_read["unsqueeze"].meta["val"].dtype == torch.float16
    _assert_caught_when_broken(case, cast, AbsBecomesNeg())


def test_a_pass_that_keeps_dtypes_is_held_to_fp32_tolerance():
    """ReluAsClamp keeps values exactly: every float output checked, none off."""
    from fx16.testing.checks import check_outputs

    case = _case([("relu", 0, 0, 0.0), ("linear", 1, 0, 0.0)])
    original = case.export()
    ep = check_pass(case, ReluAsClamp())
    assert check_outputs(original, ep, case.args) == 2


class OwnBf16Copy(torch.nn.Module):
    def forward(self, x):
        return (x * 3).to(torch.bfloat16).float() - x, x * 3


def test_a_models_own_coarser_rounding_widens_the_bound_by_one_of_its_ulps():
    """Cast to fp16, a value the model rounds to bf16 itself can fall the other way when
    the cast computes it an fp16 ulp apart (found by the long fuzz: a bf16 copy of a
    stabilized norm): the bound holds one bf16 ulp (2**-7) more; a program without a
    coarser value of its own does not get it."""
    from fx16.testing.oracle import float_bounds

    x = torch.randn(8, 16)
    original = torch.export.export(OwnBf16Copy(), (x,))
    cast = fx16.cast_fp32_to_fp16(torch.export.export(OwnBf16Copy(), (x,)))
    expected = [out.detach() for out in original.module()(x)]
    with_bf16 = float_bounds(original, cast, (x,), expected)
    assert all(bound >= 2.0**-7 for bound in with_bf16)
    plain_original = torch.export.export(_Triple(), (x,))
    plain_cast = fx16.cast_fp32_to_fp16(torch.export.export(_Triple(), (x,)))
    plain = float_bounds(plain_original, plain_cast, (x,), [plain_original.module()(x)])
    assert plain[0] < 2.0**-7


class _Triple(torch.nn.Module):
    def forward(self, x):
        return x * 3


class _TinyGuard(torch.nn.Module):
    def forward(self, x):
        return (x - x) + 1e-9, x * 3


def test_an_output_near_the_subnormals_may_be_off_by_a_subnormal_and_no_more():
    """The bound holds a few roundings of each output, and an output of 1e-9 rounds in
    steps of fp16's subnormal 2**-24, not of its own magnitude: fx16 keeps the guard
    ``0 + 1e-9`` at 2**-24 (60 times 1e-9), which the bound allows (found by the long
    fuzz); an output of ordinary size keeps its relative bound, and an output of 1e-9
    off by 10 subnormals is beyond it."""
    from fx16.testing.checks import check_outputs
    from fx16.testing.oracle import OUTPUT_ROUNDINGS, check_floats, float_bounds

    x = torch.randn(4, 8)
    original = torch.export.export(_TinyGuard(), (x,))
    cast = fx16.cast_fp32_to_fp16(torch.export.export(_TinyGuard(), (x,)))
    assert check_outputs(original, cast, (x,)) == 2
    tiny, ordinary = [out.detach() for out in original.module()(x)]
    bounds = float_bounds(original, cast, (x,), [tiny, ordinary])
    half_subnormal = 2.0**-25
    assert bounds[0] >= OUTPUT_ROUNDINGS * half_subnormal / 1e-9
    assert bounds[1] < 1e-2
    off = tiny + 10 * 2.0**-24
    with pytest.raises(AssertionError, match="float output 0"):
        check_floats(original, cast, (x,), [tiny, ordinary], [off, ordinary])


class _SquaredPastFp32(torch.nn.Module):
    """An RMS norm that squares its input: fp32 overflows inside for |x| >= 2**64."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


def test_where_fp32_overflows_inside_the_exact_result_passes_and_a_wrong_one_does_not():
    """fp32 squares a row of 1e38 to inf and its norm gives 0; fp64 gives 1, the norm
    of a constant row. A cast giving 1 there passes (fx16's stable norm does); 0.5 does
    not, and on a row fp32 computes exactly the fp64 result is no excuse for being off."""
    from fx16.testing.oracle import check_floats, exact_outputs

    loud = torch.full((2, 4), 1e38)
    original = torch.export.export(_SquaredPastFp32(), (loud,))
    fp32 = original.module()(loud)
    assert torch.equal(fp32, torch.zeros(2, 4))
    (exact,) = exact_outputs(original, (loud,))
    assert torch.equal(exact, torch.ones(2, 4)) and exact.dtype == torch.float32
    cast = fx16.cast_fp32_to_fp16(torch.export.export(_SquaredPastFp32(), (loud,)))
    assert torch.equal(cast.module()(loud).float(), exact)
    assert check_floats(original, cast, (loud,), [fp32], [exact]) == 1
    with pytest.raises(AssertionError, match="float output 0"):
        check_floats(original, cast, (loud,), [fp32], [exact / 2])
    quiet = torch.randn(2, 4)
    want = original.module()(quiet)
    with pytest.raises(AssertionError, match="float output 0"):
        check_floats(original, cast, (quiet,), [want], [want * (1 + 2.0**-6)])


class _PackedInt8(torch.nn.Module):
    """An int8 weight's packed matmul: its CPU kernel takes no fp64 input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randint(-128, 127, (8, 4), dtype=torch.int8))
        self.register_buffer("scales", torch.rand(8))

    def forward(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)


def test_a_program_that_cannot_run_in_fp64_is_held_to_fp32_alone():
    """Where the fp64 run raises, a wrong output still fails the check (the assertion,
    not the kernel's error)."""
    from fx16.testing.oracle import check_floats

    x = torch.randn(2, 4)
    original = torch.export.export(_PackedInt8(), (x,))
    cast = fx16.cast_fp32_to_fp16(torch.export.export(_PackedInt8(), (x,)))
    want = original.module()(x)
    with pytest.raises(AssertionError, match="float output 0"):
        check_floats(original, cast, (x,), [want], [want * 2])


def _explicit_fp32_norm(a):
    h = a.to(torch.float32)  # a model's own fp32 region: fp64 only if the body is widened
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))


class _SquaredInABranch(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, _explicit_fp32_norm, lambda a: a * 2, (x,))


def test_the_fp64_run_widens_inside_a_cond_branch_too():
    """The branch taken runs in fp64 as the root graph does: the loud row's norm is 1
    there (fp32 gives 0), the exact result passes and a wrong one does not."""
    from fx16.testing.oracle import check_floats, exact_outputs

    loud = torch.full((2, 4), 1e38)
    original = torch.export.export(_SquaredInABranch(), (loud,))
    fp32 = original.module()(loud)
    assert torch.equal(fp32, torch.zeros(2, 4))
    (exact,) = exact_outputs(original, (loud,))
    assert torch.equal(exact, torch.ones(2, 4))
    program = torch.export.export(_SquaredInABranch(), (loud,))
    cast = fx16.cast_fp32_to_fp16(program, explicit_fp32="calibrated")  # the norm rewritten
    assert check_floats(original, cast, (loud,), [fp32], [exact]) == 1
    with pytest.raises(AssertionError, match="float output 0"):
        check_floats(original, cast, (loud,), [fp32], [exact * 3])


class LinearInFp16(PassBase):
    """A narrowing pass that ignores range: every linear computes in fp16 (its input,
    weight and bias cast down; the node itself becomes the cast of that result back to
    fp32). Inputs of 1e5 give inf."""

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        for node in list(graph.nodes):
            if node.target != aten.linear.default:
                continue
            with graph.inserting_before(node):
                low = []
                for arg in node.args:
                    cast = graph.call_function(
                        aten._to_copy.default, (arg,), {"dtype": torch.float16}
                    )
                    cast.meta["val"] = arg.meta["val"].to(torch.float16)
                    low.append(cast)
                product = graph.call_function(aten.linear.default, tuple(low))
                product.meta["val"] = node.meta["val"].to(torch.float16)
            node.target, node.args = aten._to_copy.default, (product,)
            node.kwargs = {"dtype": torch.float32}
        graph_module.recompile()
        return PassResult(graph_module, True)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_default_fuzz_catches_a_pass_that_narrows_what_overflows(seed):
    """Once, fuzz_pass with its defaults passed a pass that runs every linear in fp16
    (on seeds 1 to 4): no program it drew held values past fp16's range at a linear.
    The entries a pass changes are swept again on inputs of 1e5, which it breaks
    whatever the seed (the sweep draws nothing at random)."""
    with pytest.raises(fx16.testing.PassBroke, match="inf/nan"):
        fx16.testing.fuzz_pass(LinearInFp16, seed=seed)
