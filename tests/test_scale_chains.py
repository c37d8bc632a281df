"""Scale domains through the other ways a program reads a scaled value's exponent or
rounds it: ``2 ** floor(log2 x)`` written with a floor division, a power of another base,
an exponent that is not the scaled value's, a log read as a feature, a quantizing
floor; and a bidirectional RNN whose two directions' weights sit at different
exponents. Each plan must apply whole and compute the model's outputs bit for bit (the
pass takes back a plan whose outputs move: a wrong rule shows as a plan taken back or a
crash), and where a rule moves the scale for free, no runtime multiply may appear."""

import pytest
import torch
from torch import nn

from fx16 import meta
from fx16.analysis.scale_domains import scale_domains
from fx16.passes.scale_domains import REVERTED
from helpers import export, range_multiplies, scale_only, scaled_exactly


def _scaled(model, *args):
    ep = scaled_exactly(model, *args)
    assert scale_domains(ep.graph_module)
    return ep


def _exponent(ep, target) -> int:
    (node,) = [n for n in ep.graph.nodes if n.target is target]
    return meta.scale_exponent(node)


class Loud(nn.Module):
    """A linear past fp16's range (~1.5e5), then ``form``'s reading of it."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.a = form, nn.Linear(16, 16)
        self.register_buffer("steps", torch.arange(16.0) / 4)
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        h = self.a(x)
        if self.form == "filled":  # its negative values replaced by -4e4 before a softmax
            return torch.where(h > 0, h, torch.full_like(h, -4e4)).softmax(-1)
        if self.form == "quantized":
            return torch.floor(h / 1000.0)
        if self.form == "plain_power":  # an exponent of the program's own
            return h * torch.pow(2.0, self.steps)
        log = torch.log2(h.abs())
        if self.form == "floor_division":  # floor(log2 |h|), as torch.div writes it
            return h / torch.pow(2.0, torch.div(log, 1, rounding_mode="floor"))
        if self.form == "halved":  # 2 ** floor(log2 |h| / 2): no shift by the scale
            return h / torch.pow(2.0, torch.div(log, 2, rounding_mode="floor"))
        if self.form == "base_three":
            return h / torch.pow(3.0, torch.floor(log))
        if self.form == "base_zero":  # 0 ** floor(log2(|h| + 1)): 0 is no power of two
            return h * torch.pow(0.0, torch.floor(torch.log2(h.abs() + 1)))
        return torch.cat([h, log], dim=-1)  # "log_feature"


def test_a_floor_division_by_one_keeps_the_exponents_shift():
    """``2 ** (log2 |h| // 1)`` (``torch.div(..., 1, rounding_mode="floor")``) with h at
    2**-k: the floor division keeps log2's shift by k, so the power is carried at 2**-k
    like h and the quotient is unscaled: no runtime multiply anywhere."""
    torch.manual_seed(0)
    model, x = Loud("floor_division").eval(), torch.randn(4, 16)
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert _exponent(ep, torch.ops.aten.pow.Scalar) == -domain.k
    assert not range_multiplies(ep)


def test_a_quantizing_floor_reads_the_quotient_its_divisor_unscaled():
    """``floor(h / 1000)`` with h at 2**-k: the scale moves into the divisor (1000 *
    2**-k), so the floor reads the quotient as it was, with no runtime multiply."""
    torch.manual_seed(0)
    model, x = Loud("quantized").eval(), torch.randn(4, 16)
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    (div,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.div.Tensor]
    assert div.args[1] == 1000.0 * 2.0**-domain.k
    assert not range_multiplies(ep)


@pytest.mark.parametrize(
    "form", ["halved", "base_three", "base_zero", "log_feature", "plain_power"]
)
def test_an_op_that_reads_a_scaled_value_otherwise_reads_it_unscaled(form):
    """A floor division by 2 of the log (not a shift by k), a power of 3 or of 0 (not a
    power of two), the log read as a feature, a power of two of an exponent the program holds:
    each reads its operand unscaled (a runtime multiply takes the scale back first),
    and the program computes what it did. (Once, the log of a value read by a floor
    division by 2, or by a power of 3, was taken for a shift: the plan moved the
    outputs and was taken back.)"""
    torch.manual_seed(0)
    model, x = Loud(form).eval(), torch.randn(4, 16)
    ep = _scaled(model, x)
    assert range_multiplies(ep)


class LiftedForwardOnly(nn.Module):
    """Raw readings (~1e5) read by a bidirectional RNN whose forward input weights are
    below fp16's normal range (~3e-6: lifted by a power of two) and whose reverse ones
    are not: the directions sit at different exponents."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(4, 8, batch_first=True, bidirectional=True)
        with torch.no_grad():
            self.rnn.weight_ih_l0.mul_(1e-5)

    def forward(self, x):
        return self.rnn(x)[0]


def test_an_rnns_directions_at_different_exponents_read_their_weights_unscaled():
    """The forward direction's input weights (lifted by 2**19 in a domain of their own)
    cannot share the reverse one's exponent: the lift is undone for the RNN, and the
    door's scale on the readings (2**-3) folds into both directions' input weights
    alike; the program computes what it did."""
    torch.manual_seed(0)
    model, x = LiftedForwardOnly().eval(), 1e5 * torch.randn(2, 5, 4)
    ep = export(model, x)
    scale_only(ep)
    assert REVERTED not in ep.graph_module.meta, ep.graph_module.meta.get(REVERTED)
    with torch.no_grad():
        assert torch.equal(model(x), ep.module()(x))
    (rnn,) = [n for n in ep.graph.nodes if n.target is torch.ops.aten.rnn_tanh.input]
    forward, reverse = rnn.args[2][0], rnn.args[2][4]  # each direction's input weights
    (door,) = [d for d in scale_domains(ep.graph_module) if d.doors == ("x",)]
    assert meta.scale_exponent(forward) == meta.scale_exponent(reverse) == door.k


class TinyGru(nn.Module):
    """A GRU whose ``which`` weights are in fp16's subnormal band (~3.5e-5, as input
    weights trained for raw units are)."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 8, batch_first=True)
        with torch.no_grad():
            getattr(self.rnn, which).mul_(1e-4)

    def forward(self, x):
        return self.rnn(x)[0]


def test_input_weights_in_the_subnormal_band_are_lifted_with_the_readings_lowered():
    """Readings in fp16's range (~1e3) read by input weights of ~3.5e-5: the weights are
    lifted by 2**15 into the normal range, and the readings brought down by 2**-15 in a
    new multiply at the input (their largest stays above 2**-8), so x W is unchanged."""
    torch.manual_seed(0)
    model, x = TinyGru("weight_ih_l0").eval(), 1e3 * torch.randn(2, 5, 4)
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert domain.k == -15 and domain.folded == ("p_rnn_weight_ih_l0",)
    assert torch.equal(ep.state_dict["rnn.weight_ih_l0"], model.rnn.weight_ih_l0 * 2.0**15)
    (door,) = [n for n in ep.graph.nodes if meta.range_scaled(n)]
    assert door.args == (ep.graph.find_nodes(op="placeholder")[-1], 2.0**-15)


class TinyGruReads(nn.Module):
    """A GRU whose input weights are in fp16's subnormal band (~3.5e-5), reading
    ``form``: the user input alone ("door"), a value computed from it ("computed"),
    the input that another op reads too ("shared"), or a buffer ("buffer")."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form, self.rnn = form, nn.GRU(4, 8, batch_first=True)
        self.register_buffer("seq", 1e3 * torch.randn(2, 5, 4))
        with torch.no_grad():
            self.rnn.weight_ih_l0.mul_(1e-4)

    def forward(self, x):
        if self.form == "computed":
            return self.rnn(x.abs())[0]
        if self.form == "shared":
            return self.rnn(x)[0], x.sum()
        if self.form == "buffer":
            return self.rnn(self.seq)[0] + x.sum()
        return self.rnn(x)[0]


def _no_domain(model, x):
    ep = scaled_exactly(model, x)
    assert not scale_domains(ep.graph_module) and not range_multiplies(ep)
    assert torch.equal(ep.state_dict["rnn.weight_ih_l0"], model.rnn.weight_ih_l0)


@pytest.mark.parametrize("form", ["computed", "shared", "buffer"])
def test_lifted_input_weights_lower_only_a_door_the_rnn_alone_reads(form):
    """The readings can be lowered by the weights' lift only at a door: a user input
    the GRU alone reads. A value computed from it, an input another op reads too (it
    would read it lowered) and a buffer (a state tensor, not a door) are not: the
    lift is undone (the weights stored as they were), no multiply is planned, and the
    program computes what it did."""
    torch.manual_seed(0)
    _no_domain(TinyGruReads(form).eval(), 1e3 * torch.randn(2, 5, 4))


def test_a_door_is_lowered_while_its_largest_stays_at_the_smallest_folded_magnitude():
    """Lowered by 2**-15, readings whose largest is exactly 2**7 reach 2**-8, the
    smallest magnitude a fold may leave: lowered. Readings of ~1e-2 would reach
    ~3e-7, below it: not lowered, and the lift undone."""
    torch.manual_seed(0)
    model, x = TinyGruReads("door").eval(), torch.randn(2, 5, 4)
    x = x / x.abs().max() * 2.0**7
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert domain.k == -15 and range_multiplies(ep) == ["mul_tensor"]
    torch.manual_seed(0)
    _no_domain(TinyGruReads("door").eval(), 1e-2 * torch.randn(2, 5, 4))


def test_input_weights_near_the_range_fold_down_with_the_readings_raised_at_the_door():
    """Input weights of 4e4 (past fp16's range with the margin) fold down by 2**-11 into
    the middle of the range, and the readings are raised by 2**11 at the door; the
    earlier, smaller raise the walk asked for (2**1) is not taken at the door, which
    only ever lowers."""
    torch.manual_seed(0)
    model, x = TinyGruReads("door").eval(), torch.randn(2, 5, 4)
    with torch.no_grad():
        weight = model.rnn.weight_ih_l0
        weight.mul_(4e4 / weight.abs().max())
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert domain.k == 11 and domain.folded == ("p_rnn_weight_ih_l0",)
    (door,) = [n for n in ep.graph.nodes if meta.range_scaled(n)]
    assert door.args == (ep.graph.find_nodes(op="placeholder")[-1], 2.0**11)


def test_tiny_recurrent_weights_other_than_the_input_ones_start_no_domain():
    """Hidden-to-hidden weights of ~3.5e-5: the scale rule of an RNN moves only its
    first layer's input weights, so they start no domain and are stored as they were."""
    torch.manual_seed(0)
    model, x = TinyGru("weight_hh_l0").eval(), torch.randn(2, 5, 4)
    ep = export(model, x)
    scale_only(ep)
    assert not scale_domains(ep.graph_module) and not range_multiplies(ep)
    assert torch.equal(ep.state_dict["rnn.weight_hh_l0"], model.rnn.weight_hh_l0)


class Compared(nn.Module):
    """Two linears past fp16's range at different exponents (~1e5 and ~3e6), compared
    with a number and with each other, their signs and argmax taken; and an integer
    comparison beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        with torch.no_grad():
            self.a.weight.mul_(1e5)
            self.b.weight.mul_(3e6)

    def forward(self, x, ids):
        h, g = self.a(x), self.b(x)
        flags = (h > 3e4).float() + (h > g).float() + torch.sign(h)
        return flags * 5.0, h.argmax(-1), (ids > 3).float() * 2.0


def test_a_comparison_reads_its_operands_at_one_exponent_and_its_number_scaled():
    """A comparison's result does not depend on a positive scale its operands share:
    ``h > 3e4`` compares h at its domain's 2**k with 3e4 * 2**k (no multiply), ``h > g``
    brings h to g's exponent with one multiply (the larger operand's exponent is the
    target), sign and argmax read h as it is, and a flag made from them is unscaled
    (``flags * 5`` is returned as computed); the integer comparison keeps its 3."""
    torch.manual_seed(0)
    model, x, ids = Compared().eval(), torch.randn(4, 16), torch.randint(0, 8, (4, 16))
    ep = _scaled(model, x, ids)
    k = {d.folded[0]: d.k for d in scale_domains(ep.graph_module)}
    k_a, k_b = k["p_a_weight"], k["p_b_weight"]
    assert k_a != k_b
    (door,) = [n for n in ep.graph.nodes if meta.range_scaled(n)]
    assert door.args[1] == 2.0 ** (k_a - k_b) and door.args[0].name == "linear"
    aten = torch.ops.aten
    by_number = {n.args[0].name: n.args[1] for n in ep.graph.nodes if n.target is aten.gt.Scalar}
    assert by_number == {"linear": 3e4 * 2.0**-k_a, "ids": 3}
    (pair,) = [n for n in ep.graph.nodes if n.target is aten.gt.Tensor]
    assert pair.args == (
        door,
        ep.graph.find_nodes(op="call_function", target=aten.linear.default)[1],
    )


def test_a_fill_in_a_domain_is_made_at_its_exponent():
    """A where picking h or a fill of -4e4, then a softmax: the fill joins h's domain
    through the ``where``: its number is made at 2**-k
    (-4e4 * 2**-k), with no multiply; the one multiply unscales the softmax's input."""
    torch.manual_seed(0)
    model, x = Loud("filled").eval(), torch.randn(4, 16)
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    (fill,) = ep.graph.find_nodes(op="call_function", target=torch.ops.aten.full_like.default)
    assert fill.args[1] == -4e4 * 2.0**-domain.k
    (multiply,) = [n for n in ep.graph.nodes if meta.range_scaled(n)]
    assert [user.target for user in multiply.users] == [torch.ops.aten.softmax.int]


class ComparedWithGained(nn.Module):
    """A linear past fp16's range (~1e5) compared with the readings times a buffer
    (``shared``: the product is also returned)."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.shared, self.a = shared, nn.Linear(16, 16)
        self.register_buffer("gain", 1 + 0.1 * torch.randn(16))
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        product = x * self.gain
        flags = (self.a(x) > product).float()
        return (flags, product) if self.shared else flags


def test_a_product_compared_with_a_scaled_value_takes_the_scale_in_its_buffer():
    """``h > x * gain`` with h at 2**-k: the product is brought to h's exponent by its
    buffer (stored at 2**-k), so the comparison reads both at 2**-k with no multiply."""
    torch.manual_seed(0)
    model, x = ComparedWithGained().eval(), torch.randn(4, 16)
    ep = _scaled(model, x)
    (domain,) = scale_domains(ep.graph_module)
    assert torch.equal(ep.state_dict["gain"], model.gain * 2.0**-domain.k)
    (mul,) = ep.graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)
    assert meta.scale_exponent(mul) == -domain.k
    assert not range_multiplies(ep)


def test_a_product_read_elsewhere_keeps_its_buffer_and_is_scaled_by_a_multiply():
    """The same comparison with ``x * gain`` also returned: a scale folded into the
    buffer would reach that output, so the buffer stays as it was and the comparison
    reads the product through a multiply."""
    torch.manual_seed(0)
    model, x = ComparedWithGained(shared=True).eval(), torch.randn(4, 16)
    ep = _scaled(model, x)
    assert torch.equal(ep.state_dict["gain"], model.gain)
    (multiply,) = [n for n in ep.graph.nodes if meta.range_scaled(n)]
    assert [user.target for user in multiply.users] == [torch.ops.aten.gt.Tensor]
