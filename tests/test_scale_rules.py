"""Scale domains through the op kinds of ``fx16.ops.scaling`` that the residual and CNN
models of ``test_scale_domains.py`` do not reach: a norm whose eps is left to its
default, attention reading a scaled mask, an LSTM after a scaled value, the exponent
chain ``2 ** floor(log2(x))``, and the
report's line for a domain. Each test checks the plan applied whole (the pass takes a
plan back when the scaled program's outputs move, so a wrong rule shows as a plan
taken back), the scaled fp32 program's outputs against the original's, and where it
casts, the 16-bit program against fp64."""

import pytest
import torch
from torch import nn

import fx16
from fx16 import meta
from fx16.analysis.scale_domains import Domain, scale_domains
from fx16.passes.scale_domains import REVERTED
from fx16.program.stats import program_stats
from helpers import check_program, export, fp64_reference, max_error, run, scale_only


def _scaled(model, *args):
    """The model exported and scaled (fp32, before any 16-bit decision); asserts the
    plan applied whole and the scaled program computes the model's outputs exactly."""
    ep = export(model, *args)
    scale_only(ep)
    assert REVERTED not in ep.graph_module.meta, ep.graph_module.meta.get(REVERTED)
    assert scale_domains(ep.graph_module)
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(model(*args))
        have = torch.utils._pytree.tree_leaves(ep.module()(*args))
    assert all(torch.equal(a, b) for a, b in zip(want, have))
    return ep


def _node(ep, name):
    (node,) = [n for n in ep.graph.nodes if n.name == name]
    return node


class DefaultEpsNorm(nn.Module):
    """A linear past fp16's range (~1e5) read by ``torch.layer_norm`` with its eps left
    to the default (the exported call does not pass it), then a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(16))
        self.shift = nn.Parameter(0.1 * torch.randn(16))
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        return self.b(torch.layer_norm(self.a(x), [16], self.gain, self.shift))


def test_a_norms_default_eps_is_passed_scaled_by_name():
    """Input graph: linear (~1e5) -> layer_norm(h, [16], w, b) (no eps argument) -> linear.
    Output: the norm reads h at 2**-k with ``eps=1e-5 * 2**-2k`` passed by name (the
    default, scaled as the variance is), no runtime multiply; cast, 100% 16-bit."""
    torch.manual_seed(0)
    model, x = DefaultEpsNorm().eval(), torch.randn(4, 16)
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    norm = _node(ep, "layer_norm")
    assert len(norm.args) == 4 and norm.kwargs == {"eps": 1e-5 * 2.0 ** (-2 * domain.k)}
    assert not [n for n in ep.graph.nodes if meta.range_scaled(n)]
    cast = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(cast)
    assert program_stats(cast).flop_share_16bit == 1.0
    assert max_error(fp64_reference(model, x), run(cast, x)) < 8 * 2.0**-11


class DefaultEpsRmsNorm(nn.Module):
    """A linear past fp16's range read by ``nn.RMSNorm`` with no eps (its default is
    the dtype's epsilon, not a number the graph holds), one row of the input quiet."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(16, 16), nn.RMSNorm(16), nn.Linear(16, 16)
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


def test_a_norm_whose_eps_is_no_number_reads_its_input_unscaled():
    """Input graph: linear (~1e5) -> rms_norm(h, [16], w) (eps=None: the dtype's
    epsilon) -> linear, one input row 1e-9 of the others (its h ~1e-4, where the eps
    matters). Output: the norm reads h through a multiply that takes its scale back
    (there is no eps to scale with it), so the scaled program is the same function on
    the quiet row too."""
    torch.manual_seed(0)
    model, x = DefaultEpsRmsNorm().eval(), torch.randn(4, 16)
    with torch.no_grad():
        model.a.bias.zero_()
    x[1] *= 1e-9
    ep = _scaled(model, x)
    norm = _node(ep, "rms_norm")
    assert meta.range_scaled(norm.args[0]) and meta.scale_exponent(norm.args[0]) == 0


class LoudMaskAttention(nn.Module):
    """Attention whose additive float mask is a linear's output past fp16's range (a
    learned position bias, ~4e5), also read by the residual; values past the range too.
    ``masked=False``: the same without the mask."""

    def __init__(self, masked: bool = True) -> None:
        super().__init__()
        self.masked = masked
        self.q, self.k, self.v = (nn.Linear(16, 16) for _ in range(3))
        self.bias = nn.Linear(16, 8)
        with torch.no_grad():
            self.bias.weight.mul_(1e5)
            self.v.weight.mul_(1e5)

    def forward(self, x):
        bias = self.bias(x)
        attended = nn.functional.scaled_dot_product_attention(
            self.q(x), self.k(x), self.v(x), attn_mask=bias if self.masked else None
        )
        return attended + bias.sum(-1, keepdim=True)


def test_attention_without_a_mask_carries_its_values_scale():
    torch.manual_seed(0)
    model, x = LoudMaskAttention(masked=False).eval(), torch.randn(2, 8, 16)
    ep = _scaled(model, x)
    attention = _node(ep, "scaled_dot_product_attention")
    assert len(attention.args) == 3
    assert meta.scale_exponent(attention) == meta.scale_exponent(attention.args[2]) < 0


def test_attention_reads_its_mask_unscaled_and_its_values_scaled():
    """Input graph: mask = linear (~4e5, in a domain), v = linear (~2e5, in a domain) ->
    sdpa(q, k, v, mask). Output: the mask reaches the attention through a multiply
    that takes its scale back (a mask is added to the scores, which are unscaled); v is
    read at its scale, which the attention's result carries."""
    torch.manual_seed(0)
    model, x = LoudMaskAttention().eval(), torch.randn(2, 8, 16)
    ep = _scaled(model, x)
    attention = _node(ep, "scaled_dot_product_attention")
    query, key, value, mask = attention.args[:4]
    assert meta.range_scaled(mask) and mask.args[0].name == "linear"
    assert not meta.range_scaled(value) and meta.scale_exponent(value) < 0
    assert meta.scale_exponent(attention) == meta.scale_exponent(value)
    assert meta.scale_exponent(query) == meta.scale_exponent(key) == 0


class ScaledIntoLstm(nn.Module):
    """A linear past fp16's range (~2e5) read by an LSTM (and returned)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.rnn = nn.Linear(8, 8), nn.LSTM(8, 8, batch_first=True)
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        h = self.a(x)
        out, _ = self.rnn(h)
        return out, h


def test_an_lstm_after_a_scaled_value_takes_its_scale_in_its_input_weights():
    """Input graph: linear (~2e5, at 2**-k) -> lstm. Output: the LSTM reads the scaled
    value as it is and its ``weight_ih`` is stored at 2**k (its gates read ``x W_ih``
    unscaled); its recurrent weights are untouched; cast, every FLOP 16-bit."""
    torch.manual_seed(0)
    model, x = ScaledIntoLstm().eval(), torch.randn(2, 5, 8)
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    lstm = _node(ep, "lstm")
    assert lstm.args[0].name == "linear" and not meta.range_scaled(lstm.args[0])
    state = ep.state_dict
    assert torch.equal(state["rnn.weight_ih_l0"], model.rnn.weight_ih_l0 * 2.0**domain.k)
    assert torch.equal(state["rnn.weight_hh_l0"], model.rnn.weight_hh_l0)
    assert torch.equal(state["rnn.bias_ih_l0"], model.rnn.bias_ih_l0)
    cast = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(cast)
    assert program_stats(cast).flop_share_16bit == 1.0
    assert max_error(fp64_reference(model, x), run(cast, x)) < 8 * 2.0**-11


class ScaledIntoBidirectionalLstm(nn.Module):
    """A linear past fp16's range read by a bidirectional LSTM whose reverse input
    weights are large (``reverse_gain`` 1e3: ~3e2, folded by more than 2**6 they would
    pass the limit; 3e4: ~1e4, no fold fits them)."""

    def __init__(self, reverse_gain: float = 1e3) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.rnn = nn.LSTM(8, 8, batch_first=True, bidirectional=True)
        with torch.no_grad():
            self.a.weight.mul_(1e5)
            self.rnn.weight_ih_l0_reverse.mul_(reverse_gain)

    def forward(self, x):
        return self.rnn(self.a(x))[0]


def test_an_lstms_input_weights_take_the_scale_together_or_not_at_all():
    """Input graph: linear (~1.5e5) -> bidirectional lstm, the reverse input weights
    ~3e2. Output: both directions' input weights folded at the domain's 2**k (the LSTM
    reads the scaled value as it is); k is centred no further than both can take (at
    k = 12 the reverse weights would pass the limit: that trial folds the forward
    weights, fails on the reverse and puts the forward back)."""
    torch.manual_seed(0)
    model, x = ScaledIntoBidirectionalLstm().eval(), torch.randn(2, 5, 8)
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert "at 12 it would change which tensors take the scale" in domain.bounded
    lstm = _node(ep, "lstm")
    assert lstm.args[0].name == "linear" and not meta.range_scaled(lstm.args[0])
    for name in ("weight_ih_l0", "weight_ih_l0_reverse"):
        want = getattr(model.rnn, name) * 2.0**domain.k
        assert torch.equal(ep.state_dict[f"rnn.{name}"], want), name


def test_an_lstm_whose_reverse_weights_take_no_fold_takes_the_scale_in_none():
    """Input graph: linear (~1.5e5, at 2**-k) -> bidirectional lstm, the reverse input
    weights ~1e4 (folded by 2**k they pass the limit). Output: neither direction's input
    weights folded (the forward ones, folded first, put back as they were), the LSTM
    reading its input through a multiply that takes the scale back."""
    torch.manual_seed(0)
    model, x = ScaledIntoBidirectionalLstm(reverse_gain=3e4).eval(), torch.randn(2, 5, 8)
    ep = _scaled(model, x)
    lstm = _node(ep, "lstm")
    (domain,) = scale_domains(ep.graph_module)
    why = f"x 2**{domain.k}: undoes a domain's scale for its reader"
    assert meta.range_scaled(lstm.args[0]) == why and meta.scale_exponent(lstm.args[0]) == 0
    for name in ("weight_ih_l0", "weight_ih_l0_reverse"):
        assert torch.equal(ep.state_dict[f"rnn.{name}"], getattr(model.rnn, name)), name


class BinaryExponent(nn.Module):
    """A value past fp16's range (~1.5e5) divided by its power of two,
    ``h / 2 ** floor(log2 |h|)``: its mantissa, in [1, 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        h = self.a(x)
        return h / torch.pow(2.0, torch.floor(torch.log2(h.abs())))


def test_an_exponent_of_a_scaled_value_shifts_by_the_scale():
    """Input graph: linear (at 2**-k) -> abs -> log2 -> floor -> pow(2.0, .) -> div.
    Output: log2 of the scaled value is k less, an exact shift that floor keeps, so
    ``2 ** floor(...)`` is carried at 2**-k like h and the quotient is unscaled: no
    runtime multiply anywhere on the chain."""
    torch.manual_seed(0)
    model, x = BinaryExponent().eval(), torch.randn(4, 16)
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert meta.scale_exponent(_node(ep, "pow_1")) == -domain.k
    assert meta.scale_exponent(_node(ep, "div")) == 0
    assert not [n for n in ep.graph.nodes if meta.range_scaled(n)]


def test_a_domains_line_says_its_values_scale_folds_doors_and_reach():
    """The report's line for a domain, whole."""
    domain = Domain(
        k=6,
        values=("p_w", "linear", "add_3"),
        folded=("p_w",),
        largest=1.5e5,
        reach=21.84,
        doors=("x", "y"),
        bounded="k = 6, the least that fits",
    )
    assert domain.describe() == (
        "linear .. add_3: 3 value(s) up to 1.5e+05 carried at 2**-6 (folded into 1 "
        "tensor(s); input(s) x, y scaled at the door; k = 6, the least that fits); holds to "
        "21.8x the calibrated magnitudes before passing 65504"
    )
    unfolded = Domain(k=3, values=("mul",), folded=(), largest=3e5, reach=1.5)
    assert unfolded.describe() == (
        "mul: 1 value(s) up to 3e+05 carried at 2**-3 (no fold); holds to 1.5x the "
        "calibrated magnitudes before passing 65504"
    )


class PositionalEpsNorm(DefaultEpsNorm):
    """The same with ``nn.LayerNorm``: its eps passed by position."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


@pytest.mark.parametrize("build", [DefaultEpsNorm, PositionalEpsNorm])
def test_a_plan_taken_back_restores_the_program_exactly(monkeypatch, build):
    """Where the scaled program's fp32 outputs move (here: made to look so), the pass
    takes its plan back whole: every state tensor as it was, every scalar (the norm's eps,
    passed by name or by position) as it was, no multiply left, no value marked scaled;
    it says why, lists no domain and reports no change."""
    import fx16.passes.scale_domains as scale_pass
    from fx16.analysis.scale_domains import ScaleDomainsAnalysis
    from fx16.program import Program

    torch.manual_seed(0)
    model, x = build().eval(), torch.randn(4, 16)
    ep = export(model, x)
    state = {name: tensor.clone() for name, tensor in ep.state_dict.items()}
    graph = str(ep.graph)
    norm_arguments = (_node(ep, "layer_norm").args, _node(ep, "layer_norm").kwargs)
    program = Program(ep)
    fx16.pipelines.run_passes(
        [fx16.analysis.CalibrationAnalysis(program), ScaleDomainsAnalysis(program, 65504 / 2)],
        ep.graph_module,
    )
    assert ep.graph_module.meta[meta.SCALE_PLAN].wanted
    monkeypatch.setattr(scale_pass, "same_outputs", lambda reference, outputs: False)
    result = scale_pass.ScaleDomainsPass(program)(ep.graph_module)
    assert result is not None and result.graph_module is ep.graph_module and not result.modified
    assert (
        ep.graph_module.meta[REVERTED] == "the scaled program's fp32 outputs moved on calibration"
    )
    assert not scale_domains(ep.graph_module)
    assert str(ep.graph) == graph
    assert all(torch.equal(ep.state_dict[name], tensor) for name, tensor in state.items())
    assert not [n for n in ep.graph.nodes if meta.SCALE_EXPONENT in n.meta]
    assert (_node(ep, "layer_norm").args, _node(ep, "layer_norm").kwargs) == norm_arguments


def test_without_a_plan_the_pass_changes_nothing_and_hands_back_its_module():
    """A program whose values all fit: the analysis plans nothing, the pass hands back
    its module unchanged."""
    from fx16.analysis.scale_domains import ScaleDomainsAnalysis
    from fx16.passes.scale_domains import ScaleDomainsPass
    from fx16.program import Program

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    ep = export(model, torch.randn(4, 16))
    program = Program(ep)
    fx16.pipelines.run_passes(
        [fx16.analysis.CalibrationAnalysis(program), ScaleDomainsAnalysis(program, 65504 / 2)],
        ep.graph_module,
    )
    graph = str(ep.graph)
    result = ScaleDomainsPass(program)(ep.graph_module)
    assert result.graph_module is ep.graph_module and not result.modified
    assert str(ep.graph) == graph


def test_the_pass_without_its_analysis_says_what_to_run_first():
    """Run alone, the pass names itself and the analysis whose plan it applies."""
    from fx16.errors import PreconditionError
    from fx16.passes.scale_domains import ScaleDomainsPass

    ep = export(nn.Linear(16, 4).eval(), torch.randn(4, 16))
    with pytest.raises(PreconditionError, match="ScaleDomainsPass reads what ScaleDomainsAnalysis"):
        ScaleDomainsPass(ep)(ep.graph_module)


def test_the_plan_check_tells_outputs_apart_beyond_fp32_rounding():
    """``same_outputs`` (the pass's check that a scaled program computes what the model
    did, before it keeps the plan): equal outputs, and floats within fp32's rounding of
    values near its range's ends, agree; a missing calibration run or output, a number or
    an integer that differs, a float beyond that rounding, an inf of the other sign or
    where a finite value was, a nan where an inf was: each does not."""
    from fx16.passes.scale_domains import same_outputs

    floats, ints = torch.tensor([1.0, 2.0]), torch.tensor([1, 2])
    reference = [[floats, ints, 3]]
    assert same_outputs(reference, [[floats.clone(), ints.clone(), 3]])
    small = [[floats, ints, 3], [torch.tensor([1.0, 0.01])]]  # two calibration runs
    assert same_outputs(small, [[floats, ints, 3], [torch.tensor([1.0, 0.01 + 1e-7])]])
    assert same_outputs(reference, [[torch.tensor([1.0, 2.0 + 1e-6]), ints, 3]])
    for outputs in (
        None,
        [],
        [[floats, ints]],
        [[floats, ints, 4]],
        [[floats, torch.tensor([1, 3]), 3]],
        [[torch.tensor([1.0, 2.01]), ints, 3]],
    ):
        assert not same_outputs(reference, outputs), outputs
    # a small value off by 5e-4: beyond fp32's rounding (1e-5 of the largest, 1e-4 of it)
    assert not same_outputs(small, [[floats, ints, 3], [torch.tensor([1.0, 0.0105])]])
    inf, nan = float("inf"), float("nan")
    for value in (torch.tensor([1.0, inf]), torch.tensor([1.0, nan]), torch.tensor([inf])):
        assert same_outputs([[value]], [[value.clone()]])
    for a, b in (([1.0, inf], [1.0, -inf]), ([1.0, inf], [1.0, 5.0]), ([1.0, nan], [1.0, inf])):
        assert not same_outputs([[torch.tensor(a)]], [[torch.tensor(b)]]), (a, b)
