"""Which values form a scale domain (``fx16.analysis.scale_members``) and which domains
are worth a plan (``fx16.analysis.scale_domains``), on models shaped as trained ones
are: a zero-initialised projection (adaLN-Zero), a batch norm whose fitted variance is
tiny, two loud streams multiplied, a product of two buffers, a value only the output
reads. Each scaled program is checked whole and exact against the model (the plan
applied, not taken back), and the cast against fp64."""

import pytest
import torch
from torch import nn

import fx16
from benchmarks.range_flows import PreNormResidual as Residual
from benchmarks.range_flows import ResidualInACond
from fx16 import meta
from fx16.analysis.scale_domains import scale_domains
from helpers import (
    check_program,
    export,
    fp64_reference,
    max_error,
    range_multiplies,
    run,
    scaled_exactly,
)

UNIT = 2.0**-11
LIMIT = 65504 / 2  # the default overflow margin's limit


def _cast_error(model, *args) -> float:
    cast = fx16.cast_fp32_to_fp16(export(model, *args))
    check_program(cast)
    return max_error(fp64_reference(model, *args), run(cast, *args))


class OnlyTheOutputReads(nn.Module):
    """A loud product the program returns as it is, and (``read``) one a norm reads."""

    def __init__(self, read: bool) -> None:
        super().__init__()
        self.read = read
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x) * 3e4
        return nn.functional.layer_norm(h, (16,)) if self.read else h


def test_a_loud_value_only_the_output_reads_takes_no_domain():
    """A scale on a value the program only returns would be undone at the output at
    once: no domain; a value a norm reads beyond the product takes one."""
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    assert not scale_domains(scaled_exactly(OnlyTheOutputReads(read=False), x).graph_module)
    assert scale_domains(scaled_exactly(OnlyTheOutputReads(read=True), x).graph_module)


class ZeroInitialised(nn.Module):
    """adaLN-Zero: a gate projection whose weight and bias start at zero (the block is
    the identity at initialisation), gating a residual stream past the range."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.gate = nn.Linear(16, 16), nn.Linear(16, 16)
        with torch.no_grad():
            self.up.weight.mul_(1e5)
            self.gate.weight.zero_()
            self.gate.bias.zero_()

    def forward(self, x):
        h = x + self.up(x)
        return nn.functional.layer_norm(h, (16,)) * self.gate(nn.functional.silu(x))


def test_a_zero_initialised_weight_seeds_no_domain():
    """A weight of zeros, and the product of it, are not below fp16's normal range:
    they have no magnitude to lift, and seed no domain."""
    torch.manual_seed(0)
    model, x = ZeroInitialised().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert "p_gate_weight" not in domain.values
    assert _cast_error(model, x) < 8 * UNIT


class LoudTimesLoud(nn.Module):
    """Two streams past the range, at magnitudes 2**12 apart, multiplied; a norm reads
    the product."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        with torch.no_grad():
            self.a.weight.mul_(1e5)
            self.b.weight.mul_(4e8)

    def forward(self, x):
        a, b = torch.relu(self.a(x)), torch.relu(self.b(x))
        return nn.functional.layer_norm(a * b + a.sum() * b.sum(), (16,))


def test_a_product_of_two_loud_streams_joins_one_of_their_domains():
    """The product joins its first operand's domain; the other stream keeps its own
    exponent, folded into its own weight."""
    torch.manual_seed(0)
    model, x = LoudTimesLoud().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    domains = scale_domains(ep.graph_module)
    assert len(domains) == 2 and len({domain.k for domain in domains}) == 2
    assert sorted(domain.folded[0] for domain in domains) == ["p_a_weight", "p_b_weight"]


class QuotientOfTinyStd(nn.Module):
    """Inputs standardised by fitted statistics where one channel barely varies in the
    data (its std 1e-5): the quotient passes the range; a norm reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.linspace(-1, 1, 16))
        self.register_buffer("std", torch.full((16,), 0.5).index_fill(0, torch.tensor([3]), 1e-5))

    def forward(self, x):
        return nn.functional.layer_norm((x - self.mean) / self.std, (16,))


def test_a_quotient_by_a_tiny_fitted_std_takes_its_scale_in_the_divisor():
    """The divisor takes the quotient's scale (stored 2**k larger), no multiply at run
    time; the numerator is read as it is."""
    torch.manual_seed(0)
    model, x = QuotientOfTinyStd().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert domain.values == ("div",) and not range_multiplies(ep)
    assert torch.equal(ep.state_dict["std"], model.std * 2.0**domain.k)
    assert torch.equal(ep.state_dict["mean"], model.mean)
    assert _cast_error(model, x) < 8 * UNIT


class GainTimesGain(nn.Module):
    """A norm's gain times a layer-scale gain, both fitted buffers, whose product passes
    the range (300 x 300)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.full((16,), 300.0))
        self.register_buffer("layer_scale", torch.linspace(200.0, 300.0, 16))
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x) * (self.gain * self.layer_scale)
        return nn.functional.layer_norm(h, (16,))


def test_a_product_of_two_buffers_takes_its_scale_in_one_of_them():
    """The product of the two buffers takes the whole scale in one (the last), the
    other stored as it was."""
    torch.manual_seed(0)
    model, x = GainTimesGain().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    (domain,) = scale_domains(ep.graph_module)
    state = ep.state_dict
    assert torch.equal(state["gain"], model.gain)
    assert torch.equal(state["layer_scale"], model.layer_scale * 2.0**-domain.k)
    assert not range_multiplies(ep)


class RuntimeWeight(nn.Module):
    """A linear layer whose weight is made at run time (a low-rank update merged into
    it, hypernetwork-style) with a stored bias: its product passes the range."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.up = nn.Parameter(torch.randn(16, 4)), nn.Parameter(torch.randn(4, 16))
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, x):
        weight = 3e3 * (self.down @ self.up)
        return nn.functional.layer_norm(nn.functional.linear(x, weight, self.bias), (16,))


def test_a_product_whose_weight_is_made_at_run_time_folds_into_what_makes_it():
    """The linear reads no state weight: the scale folds into the low-rank factors the
    weight is made from, and its bias takes it alike; no multiply at run time."""
    torch.manual_seed(0)
    model, x = RuntimeWeight().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert torch.equal(ep.state_dict["bias"], model.bias * 2.0**-domain.k)
    assert not range_multiplies(ep)
    assert _cast_error(model, x) < 16 * UNIT


class TinyVarianceBatchNorm(nn.Module):
    """A conv and an eval BatchNorm whose fitted variance is tiny in one channel (a
    feature nearly constant in the data): the norm's output passes the range and is
    read by a pooling and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.norm.running_mean.copy_(torch.linspace(-0.2, 0.2, 8))
            variance = torch.full((8,), 0.3).index_fill(0, torch.tensor([5]), 1e-9)
            self.norm.running_var.copy_(variance)
            self.norm.weight.fill_(1e3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize("decomposed", [False, True], ids=["as_exported", "decomposed"])
def test_a_batch_norm_past_the_range_carries_its_output_at_its_weights_exponent(decomposed):
    """The norm's weight and bias take the scale; decomposed, the norm is a multi-output
    op (``_native_batch_norm_legit_no_training``) and its output, read through a
    ``getitem``, keeps the weight's exponent."""
    torch.manual_seed(0)
    model, x = TinyVarianceBatchNorm().eval(), torch.randn(2, 4, 6, 6)
    ep = scaled_exactly(model, x, decompose=decomposed)
    (domain,) = scale_domains(ep.graph_module)
    assert "p_norm_weight" in domain.folded and not range_multiplies(ep)
    assert _cast_error(model, x) < 8 * UNIT


class LoudStream(nn.Module):
    """A linear layer whose weight is ``gain`` times larger: a stream past the range."""

    def __init__(self, gain: float = 1e5) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)
        with torch.no_grad():
            self.up.weight.mul_(gain)


class PositionBias(LoudStream):
    """A loud stream with a position bias made at run time (``arange``)."""

    def forward(self, x):
        h = self.up(x) + torch.arange(16, dtype=x.dtype)
        return nn.functional.layer_norm(h, (16,))


def test_a_tensor_made_at_run_time_is_unscaled_and_brought_to_the_domain():
    """``arange`` makes its values unscaled: the add brings them to the stream's
    exponent (a wrong exponent for it would move the scaled program's outputs)."""
    torch.manual_seed(0)
    model, x = PositionBias().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    assert scale_domains(ep.graph_module)
    assert _cast_error(model, x) < 8 * UNIT


class LoudSquare(LoudStream):
    """A stream past the range squared (an energy term) and normalised."""

    def __init__(self) -> None:
        super().__init__(gain=300.0)

    def forward(self, x):
        h = self.up(x)
        return nn.functional.layer_norm(h * h + h, (16,))


def test_a_square_of_a_loud_stream_is_brought_back_to_its_domains_exponent():
    """``h * h`` comes out at twice the stream's exponent; the sum with ``h`` reads it
    brought back to the stream's by a multiply after it."""
    torch.manual_seed(0)
    model, x = LoudSquare().eval(), torch.randn(4, 16)
    scaled_exactly(model, x)
    assert _cast_error(model, x) < 16 * UNIT


@pytest.mark.parametrize("build", [Residual, lambda: ZeroInitialised().eval()])
def test_a_decomposed_program_folds_into_weights_read_through_a_permute(build):
    """Core ATen writes a linear as ``addmm(b, x, permute(w))`` (and a layer norm as a
    multi-output op): the scale still folds into the weights beneath the views, as in
    the program before decomposition, with no other multiply."""
    torch.manual_seed(0)
    model, x = build(), torch.randn(4, 16)
    whole, decomposed = scaled_exactly(model, x), scaled_exactly(model, x, decompose=True)
    folds = [sorted(d.folded) for d in scale_domains(whole.graph_module)]
    assert folds and folds == [sorted(d.folded) for d in scale_domains(decomposed.graph_module)]
    assert range_multiplies(decomposed) == range_multiplies(
        whole
    )  # the door's, where x is a member
    for name, tensor in whole.state_dict.items():
        assert torch.equal(decomposed.state_dict[name], tensor)


class ScaledResidual(LoudStream):
    """A residual stream past the range whose branch is added with ``alpha`` (export
    passes it by name: ``add.Tensor(h, branch, alpha=0.5)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(16, 16)

    def forward(self, x):
        h = self.up(x)
        return nn.functional.layer_norm(torch.add(h, self.branch(h), alpha=0.5), (16,))


def test_an_op_passed_a_number_by_name_reads_its_operands_unscaled():
    """The rule tables name numbers by position: an add with ``alpha`` by name reads
    its operands unscaled (a multiply before it), and the program computes as before."""
    torch.manual_seed(0)
    model, x = ScaledResidual().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    (add,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert add.kwargs == {"alpha": 0.5} and range_multiplies(ep)
    assert _cast_error(model, x) < 16 * UNIT


class LoudArgmax(LoudStream):
    """A stream past the range whose largest feature and its index are returned."""

    def forward(self, x):
        values, indices = torch.relu(self.up(x)).max(-1)
        return nn.functional.layer_norm(values, (4,)), indices


def test_the_index_output_of_a_scaled_max_is_returned_as_it_is():
    """``max(dim)`` commutes with the scale: its values carry the domain's exponent,
    its indices none (an integer tensor takes no multiply at the output)."""
    torch.manual_seed(0)
    model, x = LoudArgmax().eval(), torch.randn(4, 16)
    ep = scaled_exactly(model, x)
    assert scale_domains(ep.graph_module) and not range_multiplies(ep)


class WideRangeSquare(nn.Module):
    """Readings from 1e3 to 1e6 whose square joins them in a sum (x + x**2, past the
    range), and a normalised reading x * rsqrt(x**2 + 1e-3)."""

    def forward(self, x):
        square = x**2
        return x + square, x * torch.rsqrt(square.abs() + 1e-3)


class SmallCubeBesideLoudSum(nn.Module):
    """Readings of about 1e-2 that a sum takes past the range (x + 7e4, normalised)
    and whose cube, about 1e-6 and already below fp16's normal range, is returned."""

    def forward(self, x):
        return nn.functional.layer_norm(x + 7e4, (x.shape[-1],)), x**3


@pytest.mark.parametrize(
    "model, draw, returned, bound",
    [
        (WideRangeSquare(), lambda: 1e3 * (1 + 1e3 * torch.rand(4, 8)), slice(None), 8 * UNIT),
        (SmallCubeBesideLoudSum(), lambda: 1e-2 * (0.5 + torch.rand(3, 2)), slice(1, None), 2**-7),
    ],
    ids=["square_would_flush", "cube_already_below"],
)
def test_a_power_the_domains_scale_would_push_below_the_range_is_computed_unscaled(
    model, draw, returned, bound
):
    """A square: x is carried at about 2**-28 for x + x**2; its square at twice that
    exponent would put the small readings' squares (1e6) below fp16's normal range,
    where they flush and their rsqrt is inf. A cube: x is carried at 2**-2 for x + 7e4;
    its cube at 2**-6 would hold 1e-6 values at 1.6e-8, about one bit where unscaled
    fp16 keeps seven (0.87 off before). The power reads x unscaled instead; the
    outputs it makes hold the bound (the cube: 16-bit's subnormal steps)."""
    torch.manual_seed(0)
    x = draw()
    ep = scaled_exactly(model.eval(), x)
    (power,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.pow.Tensor_Scalar]
    assert scale_domains(ep.graph_module) and meta.scale_exponent(power) == 0
    cast = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(cast)
    reference, got = fp64_reference(model, x)[returned], run(cast, x)[returned]
    assert all(torch.isfinite(value).all() for value in got)
    assert max_error(reference, got) < bound


class JustPastTheLimit(nn.Module):
    """Readings up to 1.5 times the limit (49,000), normalised: one step of 2 brings them
    inside it."""

    def forward(self, x):
        return nn.functional.layer_norm(x * (1.5 * LIMIT), (x.shape[-1],))


def test_a_domain_just_past_the_limit_is_carried_one_step_down():
    """Nothing is folded (the input is scaled at the door), so k is the least that fits:
    1, not more."""
    x = torch.tensor([[1.0, -0.5, 0.25, 0.75]])
    ep = scaled_exactly(JustPastTheLimit(), x)
    (domain,) = scale_domains(ep.graph_module)
    assert domain.k == 1 and "the least that fits" in domain.bounded
    # how far its values may grow: 65504 over its largest value carried at 2**-1
    assert domain.largest == 1.5 * LIMIT and domain.reach == 65504 / (1.5 * LIMIT / 2)


def test_a_decomposed_cond_branch_folds_into_its_weights_as_before():
    """Inside a cond's branch of a decomposed program the residual stream's weights are
    read through ``permute`` too: the branch's plan folds into them, with no multiply in
    any graph, as the branch of the program before decomposition does."""
    torch.manual_seed(0)
    model = ResidualInACond().eval()
    x, flag = torch.randn(4, 16), torch.ones(1)
    folds = []
    for decompose in (False, True):
        ep = scaled_exactly(model, x, flag, decompose=decompose)
        graphs = [m for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
        assert len(graphs) > 1  # the branches
        assert not [n for g in graphs for n in g.graph.nodes if meta.range_scaled(n)]
        found = scale_domains(ep.graph_module)
        folds.append(sorted(name for domain in found for name in domain.folded))
    assert folds[0] and folds[0] == folds[1]


class TinyProduct(nn.Module):
    """A product of two inputs, scaled after."""

    def forward(self, x, y):
        return (x * y) * 2.0


def test_a_stable_rewrites_negligible_part_seeds_no_domain():
    """A product observed below the normal range seeds a domain (a scale can lift it);
    marked as a stable rewrite's negligible part (the exact error of a product, whose
    flushing the rewrite proved harmless), it seeds none."""
    from fx16.analysis.scale_members import grow_domains

    ep = export(TinyProduct(), torch.randn(4), torch.randn(4))
    product = next(n for n in ep.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    (domain,) = grow_domains({product: 1e-7}, LIMIT, {}, set())
    assert product in domain
    product.meta[meta.NEGLIGIBLE] = "a product's exact error, below 2**-24 of the value"
    assert grow_domains({product: 1e-7}, LIMIT, {}, set()) == []
