"""fx16.report.envelope: the report states under which inputs a cast's decisions hold.

The figures are checked against what the fp32 model computes on the calibration
inputs, not against what the analyses recorded.
"""

import json

import pytest
import torch
from torch import nn

import fx16
from benchmarks.precision_zoo import Entropy
from benchmarks.shift_traps import FrameRmsNorm, audio_frames
from fx16.analysis.scale_domains import scale_domains
from fx16.program import Program
from fx16.program.values import program_values
from fx16.report import report_of
from fx16.report.degrees import input_degrees
from fx16.report.envelope import envelope
from helpers import command, export
from models import PositionsAndMask

NORMAL = 2.0**-14  # fp16's smallest normal


class ScaleByRowPeak(nn.Module):
    """``y = 300 x``, then each row divided by its peak: the division is singular where
    a row is silent, and nothing but calibration bounds the peak below."""

    def forward(self, x):
        y = x * 300.0
        return y / y.abs().amax(-1, keepdim=True)


def _rows(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=generator) * torch.logspace(-2, 0, 8)[:, None]


def test_the_quietest_value_a_16_bit_op_reads_and_the_largest_value_are_stated():
    calibration = [(_rows(1),), (_rows(2),)]
    ep = fx16.cast_fp32_to_fp16(export(ScaleByRowPeak(), _rows(1)), calibration=calibration)
    found = report_of(ep).totals.envelope
    peaks = [float((300 * x).abs().amax(-1).min()) for (x,) in calibration]
    largest = max(float((300 * x).abs().max()) for (x,) in calibration)
    assert found.quietest_node == "div" and abs(found.quietest / min(peaks) - 1) < 1e-3
    assert abs(found.quiet_factor - min(peaks) / NORMAL) < 1e-3 * found.quiet_factor
    assert found.headroom_node in ("mul", "abs", "amax")
    assert abs(found.headroom - 65504 / largest) < 1e-3 * found.headroom
    assert found.calibration == "observed on 2 input(s)" and found.margin == 2.0
    lines = report_of(ep).summary()
    assert "envelope: observed on 2 input(s), with an overflow margin of 2x" in lines
    quiet = next(line for line in lines if "quieter inputs" in line)
    assert f"inputs {found.quiet_factor:.3g}x quieter" in quiet and "never observed" in quiet


def test_the_margin_stated_is_the_one_cast_with():
    ep = fx16.cast_fp32_to_fp16(export(ScaleByRowPeak(), _rows(1)), overflow_margin=4.0)
    assert report_of(ep).totals.envelope.margin == 4.0
    assert "with an overflow margin of 4x" in "\n".join(report_of(ep).summary())


def test_without_calibration_nothing_is_said_to_be_observed():
    ep = fx16.cast_fp32_to_fp16(export(ScaleByRowPeak(), _rows(1)), calibration=[])
    found = report_of(ep).totals.envelope
    assert found.headroom is None and found.quiet_factor is None
    assert (
        found.lines()[-1] == "calibration skipped: no calibration inputs: nothing else was observed"
    )


def test_rewrites_and_proven_integers_hold_for_every_input():
    """A rewritten RMSNorm reads a mean of squares bounded below for any input: no quiet
    limit is stated for it; integers narrowed on declared and proven ranges count."""
    ep = fx16.cast_fp32_to_fp16(export(FrameRmsNorm(), audio_frames(8, seed=1)))
    found = report_of(ep).totals.envelope
    assert found.rewritten == 1 and found.quiet_factor is None
    ids, mask = torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.bool)
    ep = fx16.cast_to_16_bit_precision(
        export(PositionsAndMask(), ids, mask), input_ranges={"ids": (0, 99)}
    )
    narrowed = [
        n
        for n in ep.graph_module.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].dtype == torch.int16
        and n.target != torch.ops.aten._to_copy.default  # fx16's casts: no values of their own
    ]
    assert report_of(ep).totals.envelope.proven == len(narrowed) > 0


def test_the_envelope_is_in_the_json_and_on_the_command_line(tmp_path):
    ep = fx16.cast_fp32_to_fp16(export(ScaleByRowPeak(), _rows(1)))
    document = json.loads(report_of(ep).to_json())
    assert document["totals"]["envelope"]["quietest_node"] == "div"
    assert envelope(ep, 2.0) == report_of(ep).totals.envelope
    torch.export.save(export(ScaleByRowPeak(), _rows(1)), tmp_path / "peak.pt2")
    code, out, err = command("cast", tmp_path / "peak.pt2", "-o", tmp_path / "cast.pt2")
    assert code == 0, err
    assert "envelope:   quieter inputs: div reads values down to" in out + err


def test_the_rounding_16_bit_products_leave_in_logits_is_named():
    """A softmax of a 16-bit head's logits: no rule keeps the head fp32, so the envelope
    names how coarsely it rounds them (half fp16's ulp of the largest logit seen)."""
    torch.manual_seed(0)
    model = Entropy().eval()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    found = report_of(ep).totals.envelope
    with torch.no_grad():
        largest = float(model.head(x).abs().max())
    assert found.logit_product == "linear" and found.logit_node == "softmax"
    assert abs(found.logit_rounding - largest * 2.0**-11) < 1e-3 * found.logit_rounding
    assert any(line.startswith("envelope:   sharper logits:") for line in report_of(ep).summary())
    plain = fx16.cast_fp32_to_fp16(export(ScaleByRowPeak(), _rows(1)))
    assert report_of(plain).totals.envelope.logit_rounding is None


class ScoresOfTheInput(nn.Module):
    """Attention scores of the input itself, ``softmax(q kᵀ) v``: the scores grow with
    the square of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(16, 16, bias=False) for _ in range(3))

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return scores.softmax(-1) @ self.v(x)


def test_larger_inputs_are_stated_for_the_inputs_through_the_squares():
    """Once: "16-bit values stay in range up to 2.6e3x the calibrated magnitudes", while
    inputs 130x larger gave inf (the scores grow as the square). Now the factor is the
    inputs', through the product: below it the cast program stays finite, 1.5x past it
    the scores overflow."""
    torch.manual_seed(0)
    model, x = ScoresOfTheInput().eval(), torch.randn(1, 8, 16)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    found = report_of(ep).totals.envelope
    assert found.headroom_degree == 2 and found.headroom_node == "matmul"
    with torch.no_grad():
        scores = model.q(x) @ model.k(x).transpose(-1, -2)
    assert abs(found.headroom - (65504 / float(scores.abs().max())) ** 0.5) < 1e-3 * found.headroom
    line = next(line for line in report_of(ep).summary() if "larger inputs" in line)
    assert f"float inputs up to {found.headroom:.3g}x" in line and "inputs ** 2" in line
    args, _ = fx16.inputs_for(ep, x * 0.9 * found.headroom)
    assert bool(ep.module()(*args).isfinite().all())
    args, _ = fx16.inputs_for(ep, x * 1.5 * found.headroom)
    assert not bool(ep.module()(*args).isfinite().all())


class TokensThroughANorm(nn.Module):
    """Token ids -> embedding -> LayerNorm -> linear: no float input to scale."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(32, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)))


def test_a_program_of_token_ids_says_nothing_about_larger_inputs():
    """Nothing grows with a token id; once a weight was named the tightest value."""
    ep = fx16.cast_fp32_to_fp16(export(TokensThroughANorm(), torch.randint(0, 32, (2, 6))))
    assert report_of(ep).totals.envelope.headroom is None
    assert not any("larger inputs" in line for line in report_of(ep).summary())


class RawFeatures(nn.Module):
    """A tabular MLP on raw features up to 2e5: carried at 2**-k from the door. No
    biases: every value grows exactly as the inputs do, so the stated factor is exact
    (a bias makes it a bound on the safe side)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(8, 32, bias=False), nn.Linear(32, 1, bias=False)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


class Exponential(nn.Module):
    """Linear -> exp -> Linear: exp overflows where its largest argument reaches
    log(65504), long before its argument's own overflow."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(8, 16, bias=False), nn.Linear(16, 2, bias=False)

    def forward(self, x):
        return self.out(torch.exp(self.hidden(x)))


def _outputs(ep, x):
    args, kwargs = fx16.inputs_for(ep, x)
    with torch.no_grad():
        return ep.module()(*args, **kwargs)


def _holds_to(model, x, factor: float) -> None:
    """The cast program at 0.9x the stated factor: finite and within 16-bit rounding
    of fp64; at 1.1x: the tightest value has left fp16's range (inf in the outputs)."""
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    inside, outside = x * 0.9 * factor, x * 1.1 * factor
    with torch.no_grad():
        expected = model.double()(inside.double())
    model.float()
    near = _outputs(ep, inside).double()
    assert torch.isfinite(near).all()
    assert float((near - expected).abs().max() / expected.abs().max()) < 1e-2
    assert not torch.isfinite(_outputs(ep, outside)).all()


def _largest_held(model, x, names) -> float:
    """The largest magnitude the fp32 program's values ``names`` hold on ``x``."""
    program = Program.of(export(model, x))
    found = 0.0
    with torch.no_grad():
        for _, node, value in program_values(program, program.graph_inputs((x,), {})):
            if node.name in names and isinstance(value, torch.Tensor):
                found = max(found, float(value.abs().max()))
    return found


def test_inputs_scaled_at_the_door_are_held_to_what_the_door_holds():
    """Input graph: x (~2e5, fp32) * 2**-k -> cast to fp16 -> linear -> relu -> linear.
    The envelope's factor is where a 16-bit value, the door's cast among them, passes
    65504; the domain's "holds to" figure is in the same unit, about its own values:
    both checked by running at 0.9x and 1.1x."""
    torch.manual_seed(0)
    model, x = RawFeatures().eval(), torch.rand(16, 8) * 2e5
    cast = fx16.cast_fp32_to_fp16(export(model, x))
    _holds_to(model, x, report_of(cast).totals.envelope.headroom)
    (domain,) = scale_domains(cast.graph_module)
    for factor, inside in ((0.9, True), (1.1, False)):
        held = _largest_held(model, x * factor * domain.reach, domain.values) * 2.0**-domain.k
        assert (held <= 65504) == inside


def test_an_exponential_bounds_the_inputs_by_its_argument():
    """Input graph: linear -> exp -> linear, all 16-bit. The envelope names exp and
    the factor at which its largest argument reaches log(65504)."""
    torch.manual_seed(0)
    model, x = Exponential().eval(), torch.randn(16, 8)
    envelope_ = report_of(fx16.cast_fp32_to_fp16(export(model, x))).totals.envelope
    assert envelope_.headroom_node == "exp"
    _holds_to(model, x, envelope_.headroom)


class FourierFeatures(nn.Module):
    """Gaussian Fourier features: sin and cos of x @ B with B ~ N(0, 10**2)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("frequencies", torch.randn(2, 64) * 10)
        self.head = nn.Linear(128, 3)

    def forward(self, x):
        phase = x @ self.frequencies
        return self.head(torch.cat([torch.sin(phase), torch.cos(phase)], -1))


def test_an_ill_conditioned_op_reading_a_16_bit_product_is_named_with_the_remedy():
    """Input graph: matmul (16-bit, phases up to ~30) -> sin, cos (kept fp32 as
    ill-conditioned). The envelope says sin reads the product's rounding (|phase| *
    2**-11, about 1.5e-2) and names the remedy; taking it (force_fp32 of the product)
    removes the line and the error it stated."""
    torch.manual_seed(0)
    model, x = FourierFeatures().eval(), torch.rand(256, 2)
    envelope_ = report_of(fx16.cast_fp32_to_fp16(export(model, x))).totals.envelope
    assert envelope_.amplified_product == "matmul" and envelope_.amplified_node in ("sin", "cos")
    with torch.no_grad():
        phase = x.double() @ model.frequencies.double()
    assert envelope_.amplified == pytest.approx(float(phase.abs().max()) * 2.0**-11, rel=0.05)
    line = next(line for line in envelope_.lines() if "amplified rounding" in line)
    assert "force_fp32=['matmul']" in line
    with torch.no_grad():
        expected = model.double()(x.double())
    model.float()
    default = fx16.cast_fp32_to_fp16(export(model, x))
    forced = fx16.cast_fp32_to_fp16(export(model, x), force_fp32=["matmul"])
    assert report_of(forced).totals.envelope.amplified is None
    error = [float((_outputs(ep, x).double() - expected).abs().max()) for ep in (default, forced)]
    assert error[1] < error[0] / 2  # the product's rounding was most of it
    assert error[0] <= 2 * envelope_.amplified * float(model.head.weight.abs().sum(1).max())


class EnergyInAnFp32Region(nn.Module):
    """A sum of squares computed inside ``torch.autocast(enabled=False)``, read after the
    region (normalising x) and returned: it grows as the inputs squared."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            energy = x.float().pow(2).sum(-1, keepdim=True)
        return x / (energy.sqrt() + 1e-3), energy.half()


def test_a_value_out_of_an_autocast_region_grows_as_the_region_made_it():
    """The region's sum of squares, read in 16-bit after it, bounds the inputs' growth
    at (65504 / largest) ** (1/2): the figure follows the value out of the region's body
    (the region's results were once taken to grow as nothing, and the figure was that of
    x itself, 37,000 where 143 holds)."""
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    ep = fx16.cast_fp32_to_fp16(export(EnergyInAnFp32Region(), x))
    found = report_of(ep).totals.envelope
    largest = float(x.pow(2).sum(-1).max())
    assert found.headroom_degree == 2.0
    assert found.headroom == pytest.approx((65504 / largest) ** 0.5, rel=1e-3)


class SquaresOverAFlooredRoot(nn.Module):
    """Each square times every element's ``rsqrt(|x| + floor)``: an outer product."""

    def __init__(self, floor: float = 1e-3) -> None:
        super().__init__()
        self.floor = floor

    def forward(self, x):
        root = torch.rsqrt(x.abs() + self.floor)
        return (x.pow(2).unsqueeze(-1) * root.unsqueeze(-2)).mean(-1)


# 2**-10 is a 16-bit number: fx16 makes it a 0-d constant of the program, read as the floor
@pytest.mark.parametrize("floor", [1e-3, 2.0**-10])
def test_a_negative_power_of_a_floored_value_does_not_shrink_its_smallest_elements(floor):
    """``rsqrt(|x| + 1e-3)`` of an element near 0 stays ~32 as the inputs grow (the floor
    holds it): the outer product grows as the square, not as ``x**1.5``. Counted at 1.5,
    the envelope once stated 139x where the product overflowed fp16 at 0.9x that (a long
    fuzz's program); now the figure is the square's, and 0.9x of it stays finite."""
    x = torch.tensor([[0.0, 0.5, -2.0, 3.0, 1e-3]])
    ep = fx16.cast_fp32_to_fp16(export(SquaresOverAFlooredRoot(floor), x))
    found = report_of(ep).totals.envelope
    assert found.headroom_degree == 2.0
    args, _ = fx16.inputs_for(ep, x * 0.9 * found.headroom)
    assert bool(ep.module()(*args).isfinite().all())


def test_a_norms_root_mean_square_still_shrinks_with_its_inputs():
    """``x * rsqrt(mean(x**2) + eps)``: the mean of squares is far above eps on what
    calibration saw, so the norm's output grows as nothing and no figure names it."""

    class Norm(nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * 100.0

    ep = fx16.cast_fp32_to_fp16(export(Norm(), torch.randn(4, 16)), stabilize=False)
    degrees = input_degrees(ep)
    (output,) = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    assert degrees[output] == 0.0


class LoudBranch(nn.Module):
    """``x + x`` in the program's graph and, in a branch, ``tanh(x * 3 + x)`` (its sum
    larger): both sums are named ``add`` in their graphs."""

    def forward(self, x):
        doubled = x + x
        branch = torch.cond(x.amax() > 0, lambda v: torch.tanh(v * 3 + v), torch.tanh, (x,))
        return doubled, branch


def test_a_value_in_a_body_is_named_with_its_body():
    """The tightest value is the branch's ``add`` (4x the inputs, not the graph's 2x):
    the envelope names it ``true_graph_0.add``, as the report's rows do, so its figure
    is not read as the graph's own ``add``'s (the watch of the graph's ``add`` found
    it 0.73x the maximum at 1.1x the stated factor)."""
    x = torch.rand(3, 4) + 0.5
    ep = fx16.cast_fp32_to_fp16(export(LoudBranch(), x))
    found = report_of(ep).totals.envelope
    assert found.headroom_node == "true_graph_0.add"
    assert found.headroom_node in {row.node for row in report_of(ep).rows}
    assert found.headroom == pytest.approx(65504 / float((4 * x).abs().max()), rel=1e-3)


class TimesItsLayer(nn.Module):
    """``x * linear(x)`` whose bias cancels ``W x`` on the calibration input but for
    0.01: calibration sees the product small, while at larger inputs ``W x`` grows and
    the bias does not."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.layer = nn.Linear(x.shape[-1], x.shape[-1])
        with torch.no_grad():
            self.layer.bias.copy_(0.01 - x[0] @ self.layer.weight.T)

    def forward(self, x):
        return x * self.layer(x)


def test_a_value_whose_bias_cancelled_is_bounded_by_its_parts():
    """The product was judged by its calibrated maximum (0.022): 1.7e3x stated, and at
    0.9x of that the cast program gave inf. Its layer mixes degrees (a bias), so the
    product is bounded by x's maximum times the layer's plus twice its bias's: 134x,
    and the cast program at 0.9x of it stays finite."""
    torch.manual_seed(0)
    x = torch.randn(1, 8)
    model = TimesItsLayer(x).eval()
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    found = report_of(ep).totals.envelope
    plain = (65504 / float(model(x).abs().max())) ** 0.5
    assert found.headroom is not None and found.headroom < plain / 5
    args, _ = fx16.inputs_for(ep, x * 0.9 * found.headroom)
    with torch.no_grad():
        assert bool(ep.module()(*args).isfinite().all())
        assert float(model(x * 0.9 * found.headroom).abs().max()) < 65504
    args, _ = fx16.inputs_for(ep, x * 0.9 * plain)
    assert not bool(ep.module()(*args).isfinite().all())  # the old figure was false
