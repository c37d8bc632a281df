"""Scale domains on state as trained models hold it: buffers fitted to raw data that a
value is divided by, one norm module read at two places, an embedding tied to the LM
head, a bias of zeros; and a program with a domain in its graph and one in a cond's
branch. Each test checks the plan applied whole and exact (the scaled fp32 program
computes the model's outputs bit for bit), where the scale went (folded into state, or a
runtime multiply), that tied names still share one tensor, and the cast against fp64."""

import torch
from torch import nn

import fx16
from fx16 import meta
from fx16.analysis.scale_domains import scale_domains
from fx16.passes.scale_domains import REVERTED
from fx16.program.stats import program_stats
from helpers import (
    check_program,
    export,
    fp64_reference,
    max_error,
    range_multiplies,
    run,
    scale_only,
    scaled_exactly,
)

UNIT = 2.0**-11


def _cast(model, *args):
    cast = fx16.cast_fp32_to_fp16(export(model, *args))
    check_program(cast)
    assert program_stats(cast).flop_share_16bit == 1.0
    return cast


class Standardise(nn.Module):
    """Raw readings (~1e6) standardised by buffers fitted to them, ``(x - mean) / std``
    (std ~1e5, past fp16's range too), then a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", 1e6 + 1e4 * torch.randn(8))
        self.register_buffer("std", 1e5 * (1 + torch.rand(8)))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head((x - self.mean) / self.std)


def test_a_division_by_a_fitted_buffer_takes_the_numerators_scale_in_the_buffer():
    """Input graph: x (~1e6) - mean (~1e6) -> / std (~1e5) -> linear. Output: x scaled at
    the door by 2**-k, mean and std folded by 2**-k (std's own domain, at a smaller k, is
    moved to the numerator's: the quotient is unscaled with no runtime multiply)."""
    torch.manual_seed(0)
    model = Standardise().eval()
    x = model.mean + model.std * torch.randn(16, 8)
    ep = scaled_exactly(model, x)
    numerator = next(d for d in scale_domains(ep.graph_module) if "b_mean" in d.folded)
    assert numerator.doors == ("x",)
    for name in ("mean", "std"):
        assert torch.equal(ep.state_dict[name], getattr(model, name) * 2.0**-numerator.k)
    assert range_multiplies(ep) == ["mul_tensor"]  # the door's, nothing after the quotient
    cast = _cast(model, x)
    # x - mean cancels ~10x (mean / std): that many units of fp16's rounding; readings
    # spread 3x wider than calibration's hold too
    wider = model.mean + 3 * model.std * torch.randn(16, 8)
    for inputs in (x, wider):
        assert max_error(fp64_reference(model, inputs), run(cast, inputs)) < 16 * UNIT


class Gained(nn.Module):
    """A linear past fp16's range (~1e5) to which a product with a fitted buffer is
    added: the input times it ("times"), over it ("over"), or the buffer squared."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("gain", 1 + 0.1 * torch.randn(16))
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        if self.form == "times":
            g = x * self.gain
        elif self.form == "over":
            g = x / self.gain
        else:
            g = self.gain * self.gain
        return self.b(self.a(x) + g)


def test_a_product_added_to_a_scaled_value_takes_its_scale_in_the_buffer_it_reads():
    """The sum needs ``x * gain`` at the loud linear's 2**-k: the buffer is stored at
    2**-k (a divisor at 2**k), and a square ``gain * gain`` takes 2**(-k/2) in its one
    operand, which carries both factors (before, the whole 2**-k went into it, the
    square moved twice as far, and the plan was taken back: the linear stayed fp32).
    The only runtime multiply unscales the returned output."""
    for form, power in (("times", -1), ("over", 1), ("square", -0.5)):
        torch.manual_seed(0)
        model, x = Gained(form).eval(), torch.randn(4, 16)
        ep = scaled_exactly(model, x)
        (domain,) = scale_domains(ep.graph_module)
        assert domain.k % 2 == 0 or form != "square"
        assert torch.equal(ep.state_dict["gain"], model.gain * 2.0 ** (power * domain.k))
        (gain,) = [n for n in ep.graph.find_nodes(op="placeholder") if n.name == "b_gain"]
        assert meta.scale_exponent(gain) == power * domain.k  # a whole power, recorded
        (multiply,) = [n for n in ep.graph.nodes if meta.range_scaled(n)]
        assert list(multiply.users) == [ep.graph.output_node()]


def test_a_divisor_takes_the_scale_up_to_the_limit_exactly():
    """``x / gain`` brought to the loud linear's 2**-6: the divisor is stored at 2**6.
    With its largest at 32752 / 2**6 it reaches fp16's maximum over the margin (32752)
    exactly there, which still fits: no multiply takes its place."""
    torch.manual_seed(0)
    model, x = Gained("over").eval(), torch.randn(4, 16)
    with torch.no_grad():
        model.gain.mul_(32752 / 2.0**6 / model.gain.abs().max())
    ep = scaled_exactly(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert domain.k == 6 and float(ep.state_dict["gain"].abs().max()) == 32752
    (multiply,) = [n for n in ep.graph.nodes if meta.range_scaled(n)]
    assert list(multiply.users) == [ep.graph.output_node()]


class ScaledBack(nn.Module):
    """A linear past fp16's range (~1e5) times a buffer of ~1e-3, returned (~1e2)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.register_buffer("small", 1e-3 * (1 + 0.1 * torch.randn(16)))
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        return torch.mul(self.small, self.a(x))


def test_a_buffer_times_a_scaled_value_takes_the_scale_back():
    """``small * h`` with h at 2**-k and the product in range: the buffer is stored at
    2**k, so the product is unscaled where it is made, with no multiply anywhere."""
    torch.manual_seed(0)
    model, x = ScaledBack().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert torch.equal(ep.state_dict["small"], model.small * 2.0**domain.k)
    assert not range_multiplies(ep)


class LoudThenBatchNorm(nn.Module):
    """A linear past fp16's range (~1e5) normalised by a batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm = nn.Linear(16, 16), nn.BatchNorm1d(16)
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        return self.norm(self.a(x))


def test_a_batch_norm_in_training_mode_reads_its_input_unscaled():
    """Exported in training mode, the norm divides by the batch's own statistics and
    updates its running ones: it reads the linear's result unscaled (a multiply before
    it) and none of its tensors take the scale, which its running statistics, read
    only in eval, would otherwise have to follow."""
    import copy

    torch.manual_seed(0)
    model, x = LoudThenBatchNorm().train(), torch.randn(8, 16)
    ep = torch.export.export(copy.deepcopy(model), (x,))  # as it is: in training mode
    scale_only(ep)
    assert REVERTED not in ep.graph_module.meta, ep.graph_module.meta.get(REVERTED)
    (domain,) = scale_domains(ep.graph_module)
    assert set(domain.folded) == {"p_a_weight", "p_a_bias"}
    (multiply,) = [n for n in ep.graph.nodes if meta.range_scaled(n)]
    assert [user.target for user in multiply.users] == [torch.ops.aten.batch_norm.default]
    for name in ("norm.weight", "norm.bias"):
        assert torch.equal(ep.state_dict[name], model.state_dict()[name])
    with torch.no_grad():
        assert torch.equal(model(x), ep.module()(x))


class LoudInitialState(nn.Module):
    """An LSTM whose initial hidden and cell states come from a linear past fp16's
    range (~1e5)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.rnn = nn.Linear(8, 16), nn.LSTM(4, 8, batch_first=True)
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x, seq):
        h0, c0 = self.a(x).unsqueeze(0).chunk(2, dim=-1)
        return self.rnn(seq, (h0.contiguous(), c0.contiguous()))[0]


def test_an_rnns_initial_states_are_read_unscaled():
    """The LSTM's recurrence reads its initial states as they are (``W_hh h0``, and
    ``c0`` added to the new cell): each reaches it through a multiply that unscales
    it, and its input weights take no scale."""
    torch.manual_seed(0)
    model, x, seq = LoudInitialState().eval(), torch.randn(2, 8), torch.randn(2, 5, 4)
    ep = scaled_exactly(model, x, seq)
    (lstm,) = ep.graph.find_nodes(op="call_function", target=torch.ops.aten.lstm.input)
    assert all(meta.range_scaled(state) for state in lstm.args[1])
    assert torch.equal(ep.state_dict["rnn.weight_ih_l0"], model.rnn.weight_ih_l0)


class SharedNorm(nn.Module):
    """One LayerNorm module (trained weight and bias) read at two places: on a linear
    past fp16's range (~1e5) and on one in range."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 4)
        with torch.no_grad():
            self.a.weight.mul_(1e5)
            self.norm.weight.add_(0.1 * torch.randn(16))
            self.norm.bias.add_(0.1 * torch.randn(16))

    def forward(self, x):
        return self.head(self.norm(self.a(x)) + self.norm(self.b(x)))


def test_a_norm_read_at_two_places_is_not_folded_and_its_loud_input_takes_the_eps():
    """Output: the loud linear's domain folds into its own weight and bias; the shared
    norm's weight and bias are stored as they were (the in-range reader sees them
    unscaled), the loud reader's eps is scaled by 2**-2k, the other's is not."""
    torch.manual_seed(0)
    model, x = SharedNorm().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert set(domain.folded) == {"p_a_weight", "p_a_bias"}
    for name in ("norm.weight", "norm.bias", "b.weight"):
        assert torch.equal(ep.state_dict[name], model.state_dict()[name])
    eps = {node.name: node.args[4] for node in ep.graph.nodes if "layer_norm" in node.name}
    assert eps == {"layer_norm": 1e-5 * 2.0 ** (-2 * domain.k), "layer_norm_1": 1e-5}
    assert not range_multiplies(ep)
    cast = _cast(model, x)
    assert max_error(fp64_reference(model, x), run(cast, x)) < 8 * UNIT


class TiedLm(nn.Module):
    """An embedding tied to the LM head, a residual branch past fp16's range (~1e6)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.up = nn.Embedding(32, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            self.up.weight.mul_(1e5)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.up(h))


def test_a_tied_embedding_in_a_domain_is_folded_once_under_both_names():
    """Output: the tied tensor is folded by 2**-k once (the embedding reads it folded,
    so the stream starts at 2**-k; the head reads it folded too: the logits are carried
    at 2**-2k and unscaled at the output), and both names share one tensor after the
    scale and after the cast."""
    torch.manual_seed(0)
    model, ids = TiedLm().eval(), torch.randint(0, 32, (2, 5))
    ep = scaled_exactly(model, ids)
    (domain,) = scale_domains(ep.graph_module)
    assert "p_head_weight" in domain.folded and "embedding" in domain.values
    state = ep.state_dict
    assert state["embed.weight"] is state["head.weight"]
    assert torch.equal(state["head.weight"], model.head.weight * 2.0**-domain.k)
    cast = _cast(model, ids)
    assert cast.state_dict["embed.weight"].data_ptr() == cast.state_dict["head.weight"].data_ptr()
    assert max_error(fp64_reference(model, ids), run(cast, ids)) < 8 * UNIT


class ZeroBias(nn.Module):
    """A linear past fp16's range (~1e5) whose bias is all zeros (as initialised and
    as many trained biases stay), then a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.a.weight.mul_(1e5)
            self.a.bias.zero_()

    def forward(self, x):
        return self.b(self.a(x))


def test_a_zero_bias_in_a_domain_is_folded_and_sets_no_small_end():
    """The zero bias joins the loud linear's domain (folded: still zeros); a tensor of
    zeros has no magnitude to lift, so the domain's k is set by the weight alone."""
    torch.manual_seed(0)
    model, x = ZeroBias().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert {"p_a_weight", "p_a_bias"} <= set(domain.folded) and domain.k > 0
    assert torch.equal(ep.state_dict["a.bias"], torch.zeros(16))
    assert max_error(fp64_reference(model, x), run(_cast(model, x), x)) < 8 * UNIT


class LoudOutsideAndInACond(nn.Module):
    """A loud linear (~1e5) before a cond whose true branch grows a residual stream
    past fp16's range: a domain in the program's graph and one in the branch's."""

    def __init__(self) -> None:
        super().__init__()
        from benchmarks.range_flows import ResidualInACond

        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.branches = ResidualInACond()
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x, flag):
        return self.branches(self.b(self.a(x)) * 1e-5, flag)


def test_domains_of_the_program_and_of_a_body_are_all_listed():
    """``scale_domains`` lists the program graph's domain and the branch's."""
    torch.manual_seed(0)
    model, x, flag = LoudOutsideAndInACond().eval(), torch.randn(4, 16), torch.ones(1)
    ep = export(model, x, flag)
    scale_only(ep)
    assert REVERTED not in ep.graph_module.meta, ep.graph_module.meta.get(REVERTED)
    domains = scale_domains(ep.graph_module)
    assert len(domains) == 2
    assert any("p_a_weight" in d.folded for d in domains)
    assert any("p_branches_stream_embed_weight" in d.folded for d in domains)
    with torch.no_grad():
        assert torch.equal(model(x, flag), ep.module()(x, flag))


class StreamInTheFalseBranch(nn.Module):
    """A cond whose true branch is a linear and whose false branch grows a residual
    stream past fp16's range: the branch graphs take the linear's weights first, so
    the false branch's placeholders start with two it does not read."""

    def __init__(self) -> None:
        super().__init__()
        from benchmarks.range_flows import PreNormResidual

        self.stream, self.other = PreNormResidual(), nn.Linear(16, 16)

    def forward(self, x, flag):
        return torch.cond(flag.sum() > 0, self.other, self.stream, (x,))


def test_a_branch_folds_into_its_weights_past_placeholders_it_does_not_read():
    """The false branch's first weight placeholders (the true branch's linear) have no
    reader there; the stream's weights after them are still the branch's own to fold:
    its domain folds the stream's embedding. Calibrated on the false branch."""
    torch.manual_seed(0)
    model, x, flag = StreamInTheFalseBranch().eval(), torch.randn(4, 16), -torch.ones(1)
    ep = export(model, x, flag)
    (false_graph,) = [m for name, m in ep.graph_module.named_children() if "false" in name]
    first = [n for n in false_graph.graph.nodes if n.op == "placeholder"][1]
    assert first.name == "p_other_bias" and not first.users
    scale_only(ep)
    assert REVERTED not in ep.graph_module.meta, ep.graph_module.meta.get(REVERTED)
    (domain,) = scale_domains(ep.graph_module)
    assert "p_stream_embed_weight" in domain.folded
    with torch.no_grad():
        for branch in (flag, -flag):
            assert torch.equal(model(x, branch), ep.module()(x, branch))


class TinyAddend(nn.Module):
    """Buffers of ~1e-6 (below fp16's normal range) added to readings and to buffers of
    ~1 (sums of state the readings are multiplied by, or a linear's result is shifted
    by), and a linear (read twice) whose bias is ~1e-6."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        for name in ("tiny", "tiny_b", "tiny_c"):  # one per reader: each could be folded
            self.register_buffer(name, 1e-6 * torch.rand(16))
        self.register_buffer("gain", 1 + 0.1 * torch.randn(16))
        self.register_buffer("shift", 1 + 0.1 * torch.randn(16))
        with torch.no_grad():
            self.a.bias.mul_(1e-5)

    def forward(self, x):
        return (
            self.a(x + self.tiny),
            x * (self.gain + self.tiny_b),
            self.a(x) + (self.shift + self.tiny_c),
        )


def test_a_tiny_addend_or_bias_starts_no_domain():
    """A tensor below the normal range that is only added (to readings, to another
    buffer, as a linear's bias) is absorbed by what it is added to: it starts no domain
    (a seed there would lift the sum of two buffers by 2**13, and all it touches), and
    the plan is empty."""
    torch.manual_seed(0)
    model, x = TinyAddend().eval(), torch.randn(4, 16)
    ep = export(model, x)
    scale_only(ep)
    assert not scale_domains(ep.graph_module) and not range_multiplies(ep)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(x), ep.module()(x), strict=True))


class SharedBias(nn.Module):
    """A linear past fp16's range (~1e5) read by a linear whose bias is also returned."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(8, 16) * 0.1)
        self.bias = nn.Parameter(torch.randn(8))
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        return torch.nn.functional.linear(self.a(x), self.w, self.bias), self.bias * 2


def test_a_bias_read_elsewhere_brings_the_scaled_input_to_it():
    """The second linear's bias cannot take the scale (the program returns it too), so
    the product is made at the bias's exponent: its scaled input (not its weight, not
    the bias) is unscaled by a multiply before it, and the bias is stored as it was."""
    torch.manual_seed(0)
    model, x = SharedBias().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    assert torch.equal(ep.state_dict["bias"], model.bias)
    (second,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.linear.default][1:]
    scaled_input, weight, bias = second.args
    assert meta.range_scaled(scaled_input) and scaled_input.args[0].name == "linear"
    assert weight.op == bias.op == "placeholder"
