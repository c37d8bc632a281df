"""fx16.report.envelope: the report states under which inputs a cast's decisions hold.

The figures are checked against what the fp32 model computes on the calibration
inputs, not against what the analyses recorded.
"""

import json

import torch
from torch import nn

import fx16
from benchmarks.precision_zoo import Entropy
from benchmarks.shift_traps import FrameRmsNorm, audio_frames
from fx16.report import report_of
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
