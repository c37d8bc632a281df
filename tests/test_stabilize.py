"""StabilizePass: each rewrite equals its pattern in fp64, beats it in 16-bit on the
pattern's hard inputs, and leaves a program without the pattern as it was."""

import copy
import math
from pathlib import Path

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from benchmarks.shift_traps import (
    LogLikelihood,
    Spectrum,
    StftMagnitude,
    audio_frames,
    constant_stretches,
    speech,
)
from fx16.meta import (
    BOUNDED_BELOW,
    NEGLIGIBLE,
    ROUNDING_CANCELS,
    SCALAR_ROUNDS_EXACTLY,
    SCALED,
    stabilized,
)
from fx16.passes import StabilizePass
from fx16.passes.stabilize import standard_rules
from fx16.program import Program
from fx16.program.nodes import op_label
from fx16.report import report_of
from helpers import command, export, run
from models import MLP


class RmsNorm(torch.nn.Module):
    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RmsNormDivided(RmsNorm):
    def forward(self, x):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class L2Normalized(torch.nn.Module):
    def forward(self, x):
        return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True))


class Magnitude(torch.nn.Module):
    """An STFT's magnitude from its real and imaginary halves."""

    def forward(self, x):
        real, imaginary = x.chunk(2, dim=-1)
        return torch.sqrt(real * real + imaginary * imaginary)


class LogSoftmax(torch.nn.Module):
    def forward(self, x):
        return torch.log(torch.softmax(x, dim=-1))


class LogSigmoid(torch.nn.Module):
    def forward(self, x):
        return torch.log(torch.sigmoid(x))


class Log1p(torch.nn.Module):
    def forward(self, x):
        return torch.log(x + 1)


class Expm1(torch.nn.Module):
    def forward(self, x):
        return torch.exp(x) - 1


class NaiveVariance(torch.nn.Module):
    def forward(self, x):
        return x.pow(2).mean(-1, keepdim=True) - x.mean(-1, keepdim=True).pow(2)


class TanhGelu(torch.nn.Module):
    """GELU's tanh approximation written out, as GPT-2's ``gelu_new`` writes it."""

    def forward(self, x):
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class TanhGeluReordered(torch.nn.Module):
    """The same formula in another order of ops: ``x * k * (1 + c * x * x)`` inside."""

    def forward(self, x):
        inner = math.sqrt(2.0 / math.pi) * x * (1 + 0.044715 * x * x)
        return x * (torch.tanh(inner) + 1) * 0.5


class TinyEps(torch.nn.Module):
    def forward(self, x):
        return torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-12)


# rule name -> (pattern, the input domain's magnitudes, tolerance in units of fp64's eps,
# scaled by the result's (or for cancelling forms, the terms') magnitude)
CASES = {
    "rms_norm_scaling": (RmsNorm, (1e-3, 1e4), 8),
    "rms_norm_scaling/divided": (RmsNormDivided, (1e-3, 1e4), 8),
    "rms_norm_scaling/sum": (L2Normalized, (1e-3, 1e4), 8),
    "magnitude_scaling": (Magnitude, (1e-8, 1e6), 8),
    "log_softmax": (LogSoftmax, (1e-3, 50.0), 64),
    "log_sigmoid": (LogSigmoid, (1e-3, 30.0), 64),
    "log1p": (Log1p, (1e-12, 0.9), 8),
    "expm1": (Expm1, (1e-12, 10.0), 8),
    "two_pass_variance": (NaiveVariance, (1e-3, 1e3), 64),
    "tanh_gelu": (TanhGelu, (1e-3, 30.0), 64),
    "tanh_gelu/reordered": (TanhGeluReordered, (1e-3, 30.0), 64),
}


def _stabilized(model, x, **rules):
    ep = export(model, x)
    rewritten = copy.deepcopy(ep)
    assert StabilizePass(**rules)(rewritten.graph_module).modified
    rewritten.graph_module.graph.lint()  # the pass leaves linting to its callers
    rewritten.graph_module.recompile()
    return ep.graph_module, rewritten.graph_module


def _rule(case: str) -> str:
    """The rule a case is about: "rms_norm_scaling/divided" is a form of "rms_norm_scaling"."""
    return case.split("/")[0]


def _scale(name: str, x: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The magnitude a few ulps are measured against: the result's, or for a form that
    cancels (exp(x) - 1, E[x^2] - E[x]^2) the magnitude of the terms it subtracts."""
    if name == "expm1":
        return x.exp().abs().clamp(min=1)
    if name == "two_pass_variance":
        return x.pow(2).mean(-1, keepdim=True)
    return before.abs().clamp(min=1)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=examples(18), deadline=None)
@given(data=st.data())
def test_each_rewrite_equals_its_pattern_in_fp64(name, data):
    model, (smallest, largest), ulps = CASES[name]
    magnitude = data.draw(st.floats(smallest, largest))
    seed = data.draw(st.integers(0, 2**16))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed)) * magnitude
    if name == "log1p":
        x = x.clamp(-0.9, 0.9)
    before, after = _stabilized(model(), x)
    x64 = x.double()
    expected, got = before(x64)[0], after(x64)[0]
    tolerance = ulps * torch.finfo(torch.float64).eps * _scale(name, x64, expected)
    assert ((got - expected).abs() <= tolerance).all(), (expected, got)
    rule = [stabilized(n) for n in after.graph.nodes if stabilized(n)]
    assert [r[0] for r in rule] == [_rule(name)]


MARKERS = (BOUNDED_BELOW, NEGLIGIBLE, ROUNDING_CANCELS, SCALAR_ROUNDS_EXACTLY, SCALED)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rewrite_writes_only_the_markers_it_declares(name):
    """A rule's ``marks`` say which meta markers its replacement writes (the rules page
    lists them): the ones found on the rewritten graph are among them."""
    model, (smallest, _), _ = CASES[name]
    _, after = _stabilized(model(), torch.randn(3, 8) * max(smallest, 1.0))
    (rule,) = [r for r in standard_rules(torch.float16, exact=True) if r.name == _rule(name)]
    written = {key for n in after.graph.nodes for key in MARKERS if key in n.meta}
    assert written <= set(rule.marks)


# rule name -> inputs on which the pattern computed in 16-bit goes wrong
HARD_INPUTS = {
    "rms_norm_scaling": torch.tensor([[300.0, -200.0, 1.0, 0.5], [1e3, 2.0, -3.0, 4.0]]),
    "rms_norm_scaling/divided": torch.tensor([[3e-5, -2e-4, 1e-5, 5e-5], [1e3, 2.0, -3.0, 4.0]]),
    "rms_norm_scaling/sum": torch.tensor([[3e-5, -2e-4, 1e-5, 5e-5], [300.0, 2.0, -3.0, 4.0]]),
    "magnitude_scaling": torch.tensor([[300.0, 1e-4, -3e-5, 400.0, 2e-4, 4e-5]]),
    "log_softmax": torch.tensor([[0.0, -20.0, -40.0, 10.0]]),
    "log_sigmoid": torch.tensor([[-5.0, -20.0, -30.0, 3.0]]),
    "log1p": torch.tensor([[1e-4, -3e-4, 2e-5, 5e-4]]),
    "expm1": torch.tensor([[1e-4, -3e-4, 2e-5, 5e-4]]),
    "two_pass_variance": torch.tensor([[100.0, 100.5, 99.5, 100.25]]),
    # 1 + tanh(...) cancels: at x = -3 the sum is 0.004, from a tanh rounded to 5e-4
    "tanh_gelu": torch.tensor([[-3.0, -2.5, -3.5, -4.0]]),
    "tanh_gelu/reordered": torch.tensor([[-3.0, -2.5, -3.5, -4.0]]),
}


@pytest.mark.parametrize("name", sorted(HARD_INPUTS))
def test_each_rewrite_lowers_the_16_bit_error_on_hard_inputs(name):
    x = HARD_INPUTS[name]
    model = CASES[name][0]()
    before, after = _stabilized(model, x)
    reference = model.double()(x.double())
    errors = []
    for graph_module in (before, after):
        got = graph_module(x.half())[0].double()
        bad = ~torch.isfinite(got)
        errors.append(float("inf") if bad.any() else float((got - reference).abs().max()))
    plain, stable = errors
    assert stable < plain / 4, (name, plain, stable)


def test_the_eps_clamp_states_its_change_and_keeps_the_result_finite():
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    before, after = _stabilized(TinyEps(), x, eps_clamp=True)
    rule, detail = next(stabilized(n) for n in after.graph.nodes if stabilized(n))
    assert rule == "eps_clamp" and detail.startswith("eps 1e-12 -> 6.1e-05")
    assert torch.isinf(before(x.half())[0][0]).all()  # 1e-12 flushes: rsqrt(0)
    got = after(x.half())[0]
    assert torch.isfinite(got).all() and torch.allclose(got[1].float(), torch.tensor([0.2]), 1e-3)


def test_a_program_without_a_pattern_is_left_byte_identical():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    ep = export(MLP(), x)
    code = ep.graph_module.code
    assert not StabilizePass()(ep.graph_module).modified
    assert ep.graph_module.code == code
    plain = fx16.cast_fp32_to_fp16(export(MLP(), x), stabilize=False)
    stable = fx16.cast_fp32_to_fp16(export(MLP(), x))
    assert stable.graph_module.code == plain.graph_module.code


SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class NearGelu(torch.nn.Module):
    """A written-out tanh GELU with one thing changed, or a part read elsewhere too."""

    def __init__(self, beta=SQRT_2_OVER_PI, kappa=0.044715, half=0.5, leak=False):
        super().__init__()
        self.beta, self.kappa, self.half, self.leak = beta, kappa, half, leak

    def forward(self, x):
        t = torch.tanh(self.beta * (x + self.kappa * torch.pow(x, 3.0)))
        y = self.half * x * (1.0 + t)
        return (y, t) if self.leak else y


@pytest.mark.parametrize(
    "changed",
    [
        dict(beta=SQRT_2_OVER_PI * (1 + 2**-21)),  # 4 fp32 steps off: another constant
        dict(kappa=0.0447),
        dict(half=0.25),
        dict(leak=True),  # the tanh is an output too: removing it is not the rule's to do
    ],
)
def test_a_gelu_that_is_not_atens_in_fp32_is_left_as_written(changed):
    ep = export(NearGelu(**changed), torch.randn(3, 8))
    code = ep.graph_module.code
    assert not StabilizePass()(ep.graph_module).modified
    assert ep.graph_module.code == code


class FastGelu(torch.nn.Module):
    """transformers' ``FastGELUActivation``: sqrt(2/pi) truncated to 0.7978845608."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class BloomGelu(torch.nn.Module):
    """BLOOM's ``bloom_gelu_forward``: sqrt(2/pi) truncated to 0.79788456, 1e-9 off."""

    def forward(self, x):
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


@pytest.mark.parametrize(
    "model", [FastGelu(), BloomGelu(), NearGelu(beta=SQRT_2_OVER_PI * (1 - 2**-25))]
)
def test_a_gelu_whose_constants_are_atens_in_fp32_becomes_one_op(model):
    """Constants fp32 rounds to ATen's own (the fp32 program applies them so) match: the
    result is ATen's tanh GELU, within a few fp32 steps of the program's fp32 result and
    closer to the formula's fp64 value on 16-bit inputs that cancel (x near -3)."""
    x = torch.linspace(-12, 12, 97)[None]
    before, after = _stabilized(model, x)
    ops = [n.target for n in after.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.gelu.default]
    assert torch.allclose(after(x)[0], before(x)[0], rtol=4e-6, atol=1e-6)
    hard = HARD_INPUTS["tanh_gelu"]
    reference = model.double()(hard.double())
    errors = [float((m(hard.half())[0].double() - reference).abs().max()) for m in (before, after)]
    assert errors[1] < errors[0] / 4, errors


def test_the_gelu_rewrite_reads_one_input_and_keeps_every_other_use_of_it():
    """x feeds the GELU and a residual add: the rewrite replaces the GELU's eight ops
    by one ``gelu(x, approximate="tanh")`` and leaves x and the add as they were."""

    class Residual(torch.nn.Module):
        def forward(self, x):
            return TanhGelu()(x) + x

    x = torch.randn(3, 8)
    before, after = _stabilized(Residual(), x)
    ops = [n.target for n in after.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.gelu.default, torch.ops.aten.add.Tensor]
    (gelu,) = [n for n in after.graph.nodes if n.target == torch.ops.aten.gelu.default]
    assert gelu.kwargs == {"approximate": "tanh"} and gelu.meta["val"].shape == x.shape
    assert torch.equal(after(x)[0], torch.nn.functional.gelu(x, approximate="tanh") + x)


class _Offered:
    """A rule that rewrites nothing and records the ops offered to it."""

    name = "offered"

    def __init__(self, roots=None):
        if roots is not None:
            self.roots = roots
        self.seen = []

    def match(self, node):
        self.seen.append(node.target)


def test_a_rule_with_roots_is_offered_only_the_ops_it_starts_from():
    ep = export(RmsNorm(), torch.randn(2, 8))
    every, rooted = _Offered(), _Offered(roots=(torch.ops.aten.rsqrt.default,))
    assert not StabilizePass(rules=[every, rooted])(ep.graph_module).modified
    calls = [n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"]
    assert every.seen == calls  # a rule without roots: every op, in graph order
    assert rooted.seen == [torch.ops.aten.rsqrt.default]


def test_the_exact_rewrites_are_the_default_and_the_eps_clamp_is_asked_for():
    """The default cast runs every exact rule and not the one that changes results;
    ``eps_clamp=True`` adds it, ``stabilize=False`` leaves only it; the autocast preset
    gives eager autocast's ops, not rewritten ones."""
    assert [rule.name for rule in StabilizePass().rules] == list(dict.fromkeys(map(_rule, CASES)))
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]])

    def rules_run(**options):
        ep = fx16.cast_fp32_to_fp16(export(TinyEps(), x), **options)
        return [row.stabilized.split(":")[0] for row in report_of(ep).rows if row.stabilized]

    assert rules_run() == []
    assert rules_run(eps_clamp=True) == ["eps_clamp"]
    assert rules_run(eps_clamp=True, stabilize=False) == ["eps_clamp"]
    assert fx16.PrecisionPolicy().stabilize and not fx16.PrecisionPolicy().eps_clamp
    assert not fx16.PrecisionPolicy.autocast().stabilize


class NormMLP(torch.nn.Module):
    """An RMSNorm in its own fp32 region, fed activations whose squares overflow fp16."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.norm = RmsNorm()

    def forward(self, x):
        h = self.fc(x) * 40.0
        return self.norm(h.float()).to(h.dtype)


def test_stabilize_lets_the_norm_run_in_16_bit_and_says_so():
    torch.manual_seed(0)
    x, model = torch.randn(4, 16) * 30, NormMLP()
    plain = fx16.cast_fp32_to_fp16(export(model, x), explicit_fp32="calibrated", stabilize=False)
    stable = fx16.cast_fp32_to_fp16(export(model, x), explicit_fp32="calibrated")
    wide = [r for r in report_of(plain).rows if r.kind == "float" and r.dtype == "float32"]
    assert wide  # without it, the squares overflow: fp32
    rows = report_of(stable).rows
    assert not [r for r in rows if r.kind == "float" and r.dtype == "float32"]
    assert any(r.stabilized.startswith("rms_norm_scaling") for r in rows)
    assert "stabilized (rewritten for 16-bit): rms_norm_scaling x1" in report_of(stable).summary()
    with torch.no_grad():
        reference = model(x)
        got = stable.module()(x.half()).float()
    assert torch.isfinite(got).all()
    assert float((got - reference).abs().max() / reference.abs().max()) < 5e-3


def test_the_command_line_stabilizes_unless_told_not_to(tmp_path):
    torch.manual_seed(0)
    x, model = torch.randn(4, 16) * 30, NormMLP()
    torch.export.save(export(model, x), tmp_path / "norm.pt2")
    code, plain, err = command("inspect", tmp_path / "norm.pt2", "--no-stabilize")
    assert code == 0, err
    assert "stabilized" not in plain and "explicit_fp32" in plain
    code, stable, err = command("inspect", tmp_path / "norm.pt2", "--explicit-fp32", "calibrated")
    assert code == 0, err
    assert "stabilized (rewritten for 16-bit): rms_norm_scaling x1" in stable


class BranchLogSoftmax(torch.nn.Module):
    """log(softmax) inside both branches of a cond."""

    def forward(self, x):
        def log_probs(a):
            return torch.log(torch.softmax(a * 4.0, dim=-1))

        def shifted(a):
            return torch.log(torch.softmax(a - 1.0, dim=-1))

        return torch.cond(x.sum() > 0, log_probs, shifted, (x,))


def test_patterns_inside_higher_order_op_bodies_are_rewritten_too():
    x = torch.tensor([[0.0, -20.0, -40.0, 10.0]])
    ep = export(BranchLogSoftmax(), x)
    assert StabilizePass()(ep.graph_module).modified
    ep.graph_module.recompile()
    bodies = [m for name, m in ep.graph_module.named_modules() if name.endswith("_graph_0")]
    made = [stabilized(n) for body in bodies for n in body.graph.nodes if stabilized(n)]
    assert [rule for rule, _ in made] == ["log_softmax", "log_softmax"]
    got = ep.module()(x.half())[0]
    assert torch.isfinite(got).all()  # log(softmax) in fp16 gives -inf for the -40 logit
    reference = BranchLogSoftmax().double()(x.double())[0]
    assert float((got.double() - reference).abs().max()) < 0.2


class BranchRmsNorm(torch.nn.Module):
    """An RMSNorm inside both branches of a cond (the second on twice the input)."""

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda a: RmsNorm()(a), lambda a: RmsNorm()(a * 2), (x,))


@pytest.mark.parametrize("unseen", ["30x louder", "near-silent", "a quiet row beside a loud one"])
def test_a_norm_inside_a_cond_branch_holds_on_inputs_unlike_the_calibration(unseen):
    """The scaled norm in each branch, calibrated on moderate rows, stays 16-bit and
    within a few 16-bit ulps of fp64 on rows calibration never showed: activations of
    thousands (whose squares pass 65504), near-silent ones (whose squares flush), and
    both in one input. Its scale's chain (floor division, 2**k and 2**-k) is in the bodies."""
    torch.manual_seed(0)
    calibration = torch.randn(4, 32) * 10
    x = {
        "30x louder": calibration * 30,
        "near-silent": calibration * 1e-5,
        "a quiet row beside a loud one": calibration * torch.tensor([[300.0], [1e-5], [1], [1]]),
    }[unseen]
    ep = fx16.cast_fp32_to_fp16(export(BranchRmsNorm(), calibration))
    bodies = [m for name, m in ep.graph_module.named_modules() if name.endswith("_graph_0")]
    ops = [n.target for body in bodies for n in body.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten.div.Tensor_mode) == 2
    assert ops.count(torch.ops.aten.pow.Scalar) == 4
    assert not [r for r in report_of(ep).rows if r.kind == "float" and r.dtype == "float32"]
    for sign in (1.0, -1.0):  # each branch
        got = run(ep, sign * x.abs())[0]
        want = BranchRmsNorm().double()(sign * x.abs().double())
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        # each row's largest |result| is at least 1: a few fp16 ulps of it
        assert float((got.double() - want).abs().max()) < 4e-3


# trap model -> (calibration input, the unseen input it meets later, what plain 16-bit gives)
UNSEEN = {
    "log of a sigmoid, logits 3x wider": (
        lambda: LogLikelihood(),
        lambda: torch.randn(64, 16, generator=torch.Generator().manual_seed(1)),
        lambda: 3 * torch.randn(64, 16, generator=torch.Generator().manual_seed(2)),
    ),
    "STFT magnitude, audio 100x quieter": (
        lambda: StftMagnitude(),
        lambda: audio_frames(32, seed=1),
        lambda: audio_frames(32, seed=2, loudness=3e-3),
    ),
    "STFT magnitude, audio 1000x louder": (
        lambda: StftMagnitude(),
        lambda: audio_frames(32, seed=1),
        lambda: audio_frames(32, seed=2, loudness=300.0),
    ),
}


@pytest.mark.parametrize("case", UNSEEN)
def test_the_default_cast_holds_inputs_the_calibration_never_showed(case):
    """With nothing but the default options, calibrated on ordinary inputs and run on
    shifted ones: finite and within 3e-3 of fp64 with every op in 16-bit, where eager
    ``.half()`` misses that or is not finite."""
    build, example, unseen = UNSEEN[case]
    torch.manual_seed(0)
    model = build().eval()
    stable = fx16.cast_fp32_to_fp16(export(model, example()))
    x = unseen()
    with torch.no_grad():
        want = model.double()(x.double())
        model.float()
        outputs = (
            stable.module()(*Program(stable).adapt_call((x,))[0]),
            copy.deepcopy(model).half()(x.half()),
        )
    errors = []
    for got in outputs:
        got = got.double()
        finite = bool(torch.isfinite(got).all())
        errors.append(float((got - want).abs().max() / want.abs().max()) if finite else math.inf)
    assert errors[0] < 3e-3 and not errors[1] < 3e-3, errors
    rows = report_of(stable).rows
    assert not [row for row in rows if row.kind == "float" and row.dtype == "float32"]
    assert report_of(stable).totals.flop_share_16bit == 1.0


def _op_list(name: str) -> set[str]:
    """The op names (``mul.Tensor``, ``pow.Scalar_out``) listed in ``tests/data/<name>``."""
    lines = (Path(__file__).parent / "data" / name).read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


PORTABLE_OPS = _op_list("executorch_portable_ops.txt")
XNNPACK_OPS = _op_list("executorch_xnnpack_ops.txt")


def _out_variant(op: torch._ops.OpOverload) -> str | None:
    """``op``'s out variant as ExecuTorch names its kernels ("mul.out", "pow.Scalar_out"):
    the overload that takes the same arguments plus an ``out``."""
    name = op._schema.name.split("::")[1]
    packet = getattr(torch.ops.aten, name)
    arguments = [(a.name, str(a.type)) for a in op._schema.arguments]
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if any(a.is_out for a in schema.arguments) and arguments == [
            (a.name, str(a.type)) for a in schema.arguments if not a.is_out
        ]:
            return f"{name}.{overload}"
    return None


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rewrite_adds_only_ops_executorch_runs(name):
    """A program that lowers must also run: ExecuTorch's portable kernels lack some
    core ATen ops (exp2), and a rewrite that used one failed there at its first call."""
    model = CASES[name][0]()
    before, after = _stabilized(model, torch.randn(3, 8))
    added = {n.target for n in after.graph.nodes if n.op == "call_function"} - {
        n.target for n in before.graph.nodes if n.op == "call_function"
    }
    assert added
    missing = sorted(str(op) for op in added if _out_variant(op) not in PORTABLE_OPS)
    assert not missing, f"{name} adds ops ExecuTorch has no kernel for: {missing}"


def _xnnpack_takes(node: torch.fx.Node) -> bool:
    return op_label(node) in XNNPACK_OPS


@pytest.mark.parametrize("name", [case for case in sorted(CASES) if "scaling" in case])
def test_a_scale_runs_outside_the_xnnpack_delegate_in_one_piece(name):
    """Between the first op of a scale's chain that ExecuTorch's XNNPACK delegate leaves
    out (``amax``, ``log2``) and the power of two it ends in, no op is one XNNPACK takes:
    such an op would run as a delegate call of its own between two portable kernels
    (the ``mul``, ``clamp`` and ``floor`` once there gave ``benchmarks.runtime``'s Llama
    36 delegate calls against ``.half()``'s 30; 26 without them)."""
    before, after = _stabilized(CASES[name][0](), torch.randn(3, 8))
    kept = {node.name for node in before.graph.nodes}
    calls = [n for n in after.graph.nodes if n.op == "call_function" and n.name not in kept]
    powers = [n for n in calls if n.target is torch.ops.aten.pow.Scalar]
    assert powers
    ancestors: dict[torch.fx.Node, set] = {}  # among the nodes the rewrite made
    for node in calls:  # in topological order
        ancestors[node] = set().union(
            *({arg} | ancestors[arg] for arg in node.all_input_nodes if arg in ancestors)
        )
    feeding = set().union(*(ancestors[power] for power in powers))
    islands = [
        node.name
        for node in calls
        if node in feeding
        and _xnnpack_takes(node)
        and any(not _xnnpack_takes(ancestor) for ancestor in ancestors[node])
    ]
    assert not islands, f"{name}: {islands} would each be a delegate call of their own"


class BranchGelu(torch.nn.Module):
    """A written-out tanh GELU inside both branches of a cond."""

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda a: TanhGelu()(a), lambda a: TanhGelu()(a * 2), (x,))


def test_a_gelu_inside_a_cond_branch_becomes_one_op_too():
    x = torch.randn(3, 8)
    ep = export(BranchGelu(), x)
    assert StabilizePass()(ep.graph_module).modified
    ep.graph_module.recompile()
    bodies = [m for name, m in ep.graph_module.named_modules() if name.endswith("_graph_0")]
    ops = [n.target for body in bodies for n in body.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten.gelu.default) == 2 and torch.ops.aten.tanh.default not in ops
    for sign in (1, -1):
        got = ep.module()(sign * x.abs())
        want = BranchGelu()(sign * x.abs())
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def _relative_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise |got - want| / |want|, where the result is not below 1e-4 of the largest."""
    seen = want.abs() >= 1e-4 * want.abs().max()
    return ((got.double() - want) / want)[seen].abs()


@pytest.mark.parametrize(
    "shift",
    ["3x wider", "near-silent rows", "a narrow column beside a wide one"],
)
def test_the_cast_gelu_holds_inputs_unlike_its_calibration(shift):
    """Calibrated on N(0, 1); run on inputs it never saw. Every element of the default
    cast's GELU lies within 16-bit rounding (2**-9 relative, the output's and the input's
    roundings amplified by the tail's slope) of fp64's GELU of the same 16-bit input; the
    written-out form (``stabilize=False``) loses far more where ``1 + tanh`` cancels."""
    generator = torch.Generator().manual_seed(3)
    calibration = torch.randn(16, 32, generator=generator)
    x = torch.randn(16, 32, generator=generator)
    if shift == "3x wider":
        x = 3 * x
    elif shift == "near-silent rows":
        x[::2] *= 1e-3
    else:
        x[:, 0] *= 60.0  # its cube, 2e5, is past fp16's range
    x = x.half()
    want = torch.nn.functional.gelu(x.double(), approximate="tanh")
    stable = fx16.cast_fp32_to_fp16(export(TanhGelu(), calibration))
    written = fx16.cast_fp32_to_fp16(export(TanhGelu(), calibration), stabilize=False)
    fused_errors = _relative_errors(stable.module()(x), want)
    assert fused_errors.max() < 2**-9, float(fused_errors.max())
    if shift == "3x wider":  # the tail reaches x = -9, where 1 + tanh cancels
        assert _relative_errors(written.module()(x), want).max() > 30 * fused_errors.max()


def test_a_magnitude_in_range_is_the_plain_form_and_keeps_a_constant_stretch_empty():
    """A constant stretch of audio leaves the STFT's upper bins empty in fp64, and 16-bit
    products of the rounded basis leave signed noise there. Where the spectrum's largest
    part is in [1, 128), the scaled magnitude is the plain form bit for bit, which flushes
    the noise's squares; an elementwise scale computed each noise value exactly and gave
    46x fp64's largest magnitude in those bins (a bias the next layer sums)."""
    torch.manual_seed(0)
    model = Spectrum().eval()
    program = export(model, speech(2, seed=1))
    x = constant_stretches(speech(2, seed=2))

    def run(cast):
        return cast.module()(*Program(cast).adapt_call((x,))[0]).double()

    stable = fx16.cast_fp32_to_fp16(copy.deepcopy(program))
    assert any(stabilized(n) for n in stable.graph_module.graph.nodes)
    got = run(stable)
    assert torch.equal(got, run(fx16.cast_fp32_to_fp16(program, stabilize=False)))
    want = model.double()(x.double())
    hop, window, samples = 64, 128, x.shape[-1]
    inside = [f for f in range(want.shape[-1]) if samples // 3 <= hop * f]
    inside = [f for f in inside if hop * f + window <= 2 * samples // 3]
    empty_want, empty_got = want[:, 3:, inside], got[:, 3:, inside]  # past DC's leakage
    assert 1 <= float(want.abs().max()) < 128
    assert float((empty_got - empty_want).abs().max()) <= 4 * float(empty_want.abs().max())


def test_log_sigmoid_is_the_model_own_form_from_minus_8_and_rewritten_below():
    """From -8 up ``log(sigmoid(x))`` rounds twice in 16-bit, fewer times than any
    rewritten form (min(x, 0) - log1p(exp(-|x|)) was 2.5x the model's own error on
    logits near 0): the rewrite keeps it there, bit for bit, and takes over below,
    where sigmoid leaves the normal range."""
    x = torch.cat([torch.linspace(-8, 12, 4001), torch.linspace(-60, -8.01, 500)])[None]
    _, after = _stabilized(LogSigmoid(), x)
    got = after(x.half())[0]
    kept = x[0] >= -8
    assert torch.equal(got[0, kept], torch.log(torch.sigmoid(x.half()))[0, kept])
    want = torch.nn.functional.logsigmoid(x[0, ~kept].double())
    assert torch.isfinite(got).all()
    assert float(((got[0, ~kept].double() - want) / want).abs().max()) <= 2**-11
    again = export(after, x)  # its own result, exported anew, is not matched again
    assert not StabilizePass()(again.graph_module).modified


def test_a_divided_norm_stays_divided():
    """``x / sqrt(mean(x**2) + eps)`` rewritten keeps its division: a power of two scales
    every value it computes, so in range each rounds as the model's own form does (as
    ``y * rsqrt(...)`` its result was 1.16x the model's own error on audio frames)."""
    _, after = _stabilized(RmsNormDivided(), torch.randn(3, 8))
    output = next(n for n in after.graph.nodes if n.op == "output").args[0][0]
    assert output.target is torch.ops.aten.div.Tensor
    assert output.args[1].target is torch.ops.aten.sqrt.default


def _upcast_norm(a):
    h = a.to(torch.float32)  # the model's own fp32 region: what "keep" keeps
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(a.dtype) + a


class BranchUpcastNorm(torch.nn.Module):
    """An RMSNorm in an fp32 region the model opens, inside both branches of a cond."""

    def forward(self, x):
        return torch.cond(x.sum() > 0, _upcast_norm, lambda a: _upcast_norm(a * 2), (x,))


def test_a_norm_in_a_kept_region_inside_a_cond_is_left_as_written():
    """With the model's regions kept (the default), the branches' norms stay the model's
    own fp32 ops: the region is found inside the bodies too; ``calibrated`` rewrites
    them there."""
    x = torch.randn(3, 8)
    kept = fx16.cast_fp32_to_fp16(export(BranchUpcastNorm(), x))
    retargeted = fx16.cast_fp32_to_fp16(export(BranchUpcastNorm(), x), explicit_fp32="calibrated")

    def rewrites(ep):
        return [
            stabilized(n)[0]
            for module in ep.graph_module.modules()
            if isinstance(module, torch.fx.GraphModule)
            for n in module.graph.nodes
            if stabilized(n)
        ]

    assert rewrites(kept) == []
    assert rewrites(retargeted) == ["rms_norm_scaling", "rms_norm_scaling"]
    for sign in (1.0, -1.0):
        x = sign * torch.rand(3, 8) + sign
        want = BranchUpcastNorm().double()(x.double())
        for ep in (kept, retargeted):  # the retargeted branches' fp32-grade statistic too
            got = run(ep, x)[0].double()
            assert float((got - want).abs().max() / want.abs().max()) < 2e-3


def _magnitude(a):
    half = a * 0.5  # real and imaginary parts: a and a / 2
    return torch.sqrt(a * a + half * half)


class BranchMagnitude(torch.nn.Module):
    """A complex magnitude inside both branches of a cond."""

    def forward(self, x):
        return torch.cond(x.sum() > 0, _magnitude, lambda a: _magnitude(a - 1), (x,))


@pytest.mark.parametrize("loudness", [1.0, 1e-4, 1e3])
def test_a_magnitude_inside_a_cond_branch_is_scaled_only_out_of_range(loudness):
    """In each branch: the plain form's value bit for bit at loudness 1, and within a few
    16-bit ulps of fp64 where the plain form flushes (1e-4) or overflows (1e3)."""
    calibration = torch.rand(3, 8) + 0.5
    ep = fx16.cast_fp32_to_fp16(export(BranchMagnitude(), calibration))
    for sign in (1.0, -1.0):
        x = sign * (torch.rand(3, 8) + 0.5) * loudness
        got = run(ep, x)[0].double()
        want = BranchMagnitude().double()(x.double())
        assert torch.isfinite(got).all()
        assert float(((got - want) / want).abs().max()) < 3 * 2**-11
        if loudness == 1.0:
            assert torch.equal(got, BranchMagnitude()(x.half()).double())


@pytest.mark.parametrize("eps", [1e-3, 1e-2, 0.1])
def test_a_quiet_row_under_a_large_eps_keeps_its_value(eps):
    """Rows below 2**-8 used to be divided by 2**-14 whatever eps was: eps / s**2, the eps
    term in y's units, passed 65504 for eps above 1.2e-4 and the row came out 0 (its
    true value x / sqrt(eps) is not). The clamp's floor is now sqrt(eps)'s power of two
    where that is larger: the row keeps its value to a few 16-bit ulps."""
    calibration = torch.randn(4, 16)
    ep = fx16.cast_fp32_to_fp16(export(RmsNorm(eps), calibration))
    x = torch.randn(4, 16) * torch.tensor([[1e-4], [3e-3], [1.0], [30.0]])
    got = run(ep, x)[0].double()
    want = RmsNorm(eps).double()(x.double())
    scale = want.abs().amax(-1, keepdim=True)
    assert float(((got - want).abs() / scale).max()) < 4 * 2**-11
