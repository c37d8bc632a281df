"""fx16.analysis.scale_centre: a scale domain's exponent is centred between the least
that fits its largest value and the most its folded tensors allow, so that it holds
at least as far as the fp32 path where the small end allows."""

import math
import re

import pytest
import torch
from test_scale_rules import DefaultEpsNorm
from torch import nn

import fx16
from benchmarks.range import GrowingCnn, RawUnits
from benchmarks.range_flows import PreNormResidual
from fx16.analysis.scale_domains import scale_domains
from fx16.policy.options import Fp16Options
from helpers import check_program, export, fp64_reference, max_error, run, scale_only

LADDER = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)


def _holds_to(ep, model, x) -> float:
    """The largest factor of ``LADDER`` up to which every output stays finite and
    within 1e-2 of fp64 (the ladder's first failure ends it)."""
    held = 0.0
    for factor in LADDER:
        outputs = run(ep, x * factor)
        finite = all(bool(torch.isfinite(out).all()) for out in outputs)
        if not finite or max_error(fp64_reference(model, x * factor), outputs) > 1e-2:
            break
        held = factor
    return held


def test_a_growing_cnn_holds_at_least_as_far_as_the_fp32_path():
    """A CNN whose activations grow 8x a block (three domains, each folded into the
    BatchNorm weight that opens it): with the least k each domain held to about 3x its
    calibration inputs (NaN at 4x) where ``scale_range=False`` held to 4x. Centred, the
    program holds at least as far as the fp32 path, at no loss at 1x, 100% 16-bit."""
    torch.manual_seed(0)
    model, x = GrowingCnn().eval(), torch.randn(2, 8, 16, 16)
    default = fx16.cast_fp32_to_fp16(export(model, x))
    fp32_path = fx16.cast_fp32_to_fp16(
        export(model, x), policy=fx16.PrecisionPolicy.default(scale_range=False)
    )
    check_program(default)
    domains = scale_domains(default.graph_module)
    assert len(domains) == 3 and all(domain.reach >= 6 for domain in domains)
    assert _holds_to(default, model, x) >= _holds_to(fp32_path, model, x) >= 4
    assert max_error(fp64_reference(model, x), run(default, x)) < 4 * 2.0**-11
    assert fx16.report.report_of(default).totals.flop_share_16bit == 1.0


def test_the_report_says_what_bounded_k_at_each_end():
    """Each domain line names the least k that fits and the most its small end allows,
    with the folded tensor that bounds it, and what stopped a larger raise."""
    torch.manual_seed(0)
    model, x = GrowingCnn().eval(), torch.randn(2, 8, 16, 16)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    for domain in scale_domains(ep.graph_module):
        assert "the least that fits" in domain.bounded, domain.bounded
        assert f"k = {domain.k}," in domain.bounded
        assert "the most at which p_features_" in domain.bounded
        assert domain.bounded in domain.describe()
        ends = re.search(r"centred between (\d+) \(the least that fits\) and (\d+)", domain.bounded)
        assert int(ends[1]) <= domain.k <= int(ends[2])  # k lies between the ends it names
    assert "centred between" in "\n".join(fx16.report.report_of(ep).summary())


def test_a_domain_folding_nothing_keeps_the_least_k():
    """Raw units scaled at the door fold their scale into the first layer's weight
    (the door's multiply starts the domain): the door's values have no known small
    end, so k is the least that fits, and the report says why."""
    torch.manual_seed(0)
    model, x = RawUnits().eval(), torch.rand(8, 16) * 1e6
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    (door,) = [d for d in scale_domains(ep.graph_module) if d.doors]
    limit = 65504 / Fp16Options().overflow_margin
    assert door.k == max(1, math.ceil(math.log2(door.largest / limit)))
    assert "the least that fits" in door.bounded
    assert "centred" not in door.bounded


def test_each_end_of_k_is_named_with_what_bounds_it():
    """The report's words for the small end, whole: a bias folded keeps its largest in
    fp16's normal range, a weight at least 2**-8; a domain that folds nothing (a door)
    has no known small end."""

    def bounded(model, x):
        torch.manual_seed(0)
        ep = fx16.cast_fp32_to_fp16(export(model().eval(), x))
        return [domain for domain in scale_domains(ep.graph_module) if domain.bounded]

    (biased,) = bounded(DefaultEpsNorm, torch.randn(4, 16))
    assert biased.bounded.endswith(
        "(the most at which p_a_bias's largest, 0.248, folded stays in fp16's normal range)"
    )
    (weighted,) = bounded(PreNormResidual, torch.randn(4, 16))
    assert weighted.bounded.endswith(
        "(the most at which p_embed_weight's largest, 0.25, folded stays at least 2**-8)"
    )
    (door,) = bounded(RawUnits, torch.rand(8, 16) * 1e6)
    assert door.bounded == (
        f"k = {door.k}, the least that fits (it folds no state tensor: its small end is not known)"
    )


class AddsSmall(nn.Module):
    """A linear past fp16's range (~1e5) plus a small number, then a linear."""

    def __init__(self, number: float) -> None:
        super().__init__()
        self.number = number
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        with torch.no_grad():
            self.a.weight.mul_(1e5)

    def forward(self, x):
        return self.b(self.a(x) + self.number)


@pytest.mark.parametrize(
    ("number", "k"),
    [
        (1e-3, 4),  # at 6 (and 5) 1e-3 * 2**-k is subnormal; at 4, 6.25e-5
        (2.0**-10, 4),  # at 4 exactly fp16's smallest normal, 2**-14: still normal
        (2.0**-11, 3),  # at 3, the least that fits, exactly 2**-14; any higher is subnormal
    ],
)
def test_centring_stops_before_it_takes_a_scalar_below_the_normal_range(number, k):
    """Centring would raise k to 6 (its weights allow 11), but not where the added number,
    scaled with the domain, would leave fp16's normal range (below 2**-14: at it is
    normal); the domain's description names the first exponent it tried and why not."""
    torch.manual_seed(0)
    ep = export(AddsSmall(number).eval(), torch.randn(4, 16))
    scale_only(ep)
    (domain,) = scale_domains(ep.graph_module)
    assert domain.k == k
    said = "; at 6 it would take a scalar of add below fp16's normal range)"
    assert domain.bounded.endswith(said)
    (add,) = ep.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)
    assert add.args[1] == number * 2.0**-k
