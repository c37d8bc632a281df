"""``fx16.report.growth_bounds``: a value that mixes degrees of growth (a layer's bias, a
sum with a constant, a logarithm) is bounded by its parts, |v(f x)| <= B f**d for f >= 1,
where its calibrated maximum is not a bound."""

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from fx16.report.degrees import input_degrees
from fx16.report.growth_bounds import growth_bounds
from helpers import export


class TimesItsLayer(nn.Module):
    """``x * linear(x)``, its bias set to cancel ``W x`` on ``x`` but for ``rest``."""

    def __init__(self, x: torch.Tensor, rest: float, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layer = nn.Linear(x.shape[-1], x.shape[-1])
        with torch.no_grad():
            self.layer.bias.copy_(rest - x[0] @ self.layer.weight.T)

    def forward(self, x):
        return x * self.layer(x)


def _bounds(model: nn.Module, x: torch.Tensor, calibration=None):
    ep = fx16.cast_fp32_to_fp16(export(model, x), calibration=calibration)
    degrees = input_degrees(ep)
    return ep, degrees, growth_bounds(ep, degrees)


def _output_node(ep):
    (output,) = [n for n in ep.graph.nodes if n.op == "output"]
    return output.args[0][0]


@settings(max_examples=examples(20), deadline=None)
@given(
    rest=st.floats(1e-3, 1.0),
    seed=st.integers(0, 2**16),
    factor=st.floats(1.0, 1e3),
)
def test_property_a_product_with_a_cancelled_bias_stays_below_its_bound(rest, seed, factor):
    """For any bias that cancels the layer on the calibration input and any f >= 1, the
    fp64 product at f x is within B f**2, B the bound of the cast's product; its
    calibrated maximum (f**2 times it) is not a bound once f W x outgrows the rest."""
    x = torch.randn(1, 8, generator=torch.Generator().manual_seed(seed))
    model = TimesItsLayer(x, rest, seed).eval()
    ep, degrees, bounds = _bounds(model, x)
    product = _output_node(ep)
    while product not in bounds and product.args:  # the cast's own cast back
        product = product.args[0]
    assert degrees[product] == 2 and bounds[product] is not None
    with torch.no_grad():
        grown = float(model.double()(x.double() * factor).abs().max())
    assert grown <= bounds[product] * factor**2 * (1 + 1e-6)


class BiasInABranch(nn.Module):
    """A layer with a bias inside each branch of a ``torch.cond``, doubled outside."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        branch = torch.cond(x.sum() > 0, self.layer, lambda v: self.layer(v) * 0.5, (x,))
        return branch * 2.0


def test_a_bound_made_in_a_body_reaches_the_op_reading_its_result():
    """The branches' layers mix degrees (their bias); the cond's result stands for the
    branches' outputs, so the product outside the bodies is bounded too, by the larger
    (not judged by its calibrated maximum as if it mixed nothing). Calibrated on x and
    -x, both branches ran."""
    torch.manual_seed(0)
    x = torch.randn(3, 4).abs()
    ep, _, bounds = _bounds(BiasInABranch().eval(), x, calibration=[(x,), (-x,)])
    doubled = [n for n in ep.graph.nodes if n.op == "call_function" and n.name.startswith("mul")]
    assert doubled and all(bounds.get(node) is not None for node in doubled)


class LogOfInput(nn.Module):
    def forward(self, x):
        return x.abs().add(1.0).log() * x


def test_a_logarithm_grows_with_its_argument_and_is_bounded_by_its_parts():
    """``log(f v) = log v + log f``: the log (here rewritten to ``log1p(|x|)``) takes its
    argument's degree (it was 0, a bounded op), and its bound holds at inputs 100x the
    calibration's."""
    x = torch.tensor([[0.01, -0.02, 0.015]])
    ep, degrees, bounds = _bounds(LogOfInput().eval(), x)
    (log,) = [n for n in ep.graph.nodes if n.op == "call_function" and "log" in n.name]
    assert degrees[log] == 1.0 and bounds[log] is not None
    grown = float((x.double() * 100).abs().add(1).log().abs().max())
    assert grown <= bounds[log] * 100
