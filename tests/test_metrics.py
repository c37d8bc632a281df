"""fx16.accuracy.metrics and the budget's metric= and validation=: the search meets the budget in
the user's metric and reports inputs it never saw."""

import copy

import pytest
import torch

import fx16
from fx16.accuracy.metrics import PRESETS, cosine, relative, top1
from fx16.choices import METRIC_PRESETS
from fx16.report import report_of
from helpers import command, export


def test_the_presets_measure_what_they_say():
    ref = [[torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])]]
    same = [[ref[0][0].clone()]]
    flipped = [[torch.tensor([[1.0, 3.0, 2.0], [3.0, 2.0, 1.0]])]]
    assert relative(ref, same) == cosine(ref, same) == top1(ref, same) == 0.0
    assert top1(ref, flipped) == 0.5  # one row of two changes its class
    assert relative(ref, flipped) == pytest.approx(1 / 3)
    assert 0 < cosine(ref, flipped) < 0.1
    assert cosine(ref, [[torch.full((2, 3), float("inf"))]]) == 1.0
    assert tuple(PRESETS) == METRIC_PRESETS  # the command line's list, kept torch-free


class NearTies(torch.nn.Module):
    """A classifier whose first two classes score within a hair of each other: fp16
    rounding flips the top-1 class of some rows."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 4)
        with torch.no_grad():
            self.out.weight[1] = self.out.weight[0] + 1e-4 * torch.randn(32)
            self.out.bias[1] = self.out.bias[0]

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def _classifier():
    torch.manual_seed(0)
    model = NearTies().eval()
    calibration = [(torch.randn(64, 16),) for _ in range(4)]
    validation = [(torch.randn(64, 16),) for _ in range(4)]
    return model, export(model, *calibration[0]), calibration, validation


def _top1_on(model, ep, calls) -> float:
    with torch.no_grad():
        reference = [[model(*call)] for call in calls]
        got = [[ep.module()(*fx16.inputs_for(ep, *call)[0])] for call in calls]
    return top1(reference, got)


def test_a_top1_budget_keeps_top1_agreement_on_validation_inputs():
    model, ep, calibration, validation = _classifier()
    plain = fx16.cast_fp32_to_fp16(copy.deepcopy(ep))
    assert _top1_on(model, plain, validation) > 0.01  # the plain cast flips classes
    cast = fx16.cast_fp32_to_fp16(
        ep, max_rel_error=0.0, metric="top1", calibration=calibration, validation=validation
    )
    search = report_of(cast).accuracy
    assert search.metric == "top1" and search.error == 0.0 and search.plain_error > 0
    assert search.validation_error == 0.0 and search.validation_met
    assert _top1_on(model, cast, validation) == 0.0
    assert search.flop_share_16bit > 0.5  # not everything went back to fp32
    assert "top1 error 0 on the calibration inputs" in search.describe()
    assert "0 on the validation inputs (within budget)" in search.describe()


def test_a_callable_metric_is_used_and_validation_is_never_searched_on():
    model, ep, calibration, validation = _classifier()
    seen = []

    def worst_logit_gap(reference, outputs):
        seen.append(len(reference))
        return max(float((r[0] - o[0].float()).abs().max()) for r, o in zip(reference, outputs))

    cast = fx16.cast_fp32_to_fp16(
        ep,
        max_rel_error=1.0,
        metric=worst_logit_gap,
        calibration=calibration[:2],
        validation=validation,
    )
    search = report_of(cast).accuracy
    assert search.metric == "worst_logit_gap"
    # the search on both inputs (one at a time to estimate its margin), then validation
    assert set(seen[:-1]) <= {1, 2} and seen[-1] == 4
    assert report_of(cast).provenance["options"]["metric"].endswith("worst_logit_gap")


def test_metric_and_validation_need_a_budget():
    _, ep, calibration, _ = _classifier()
    for option in ({"metric": "top1"}, {"validation": calibration}):
        with pytest.raises(fx16.InvalidOptionError, match="needs max_rel_error"):
            fx16.cast_fp32_to_fp16(ep, **option)
    with pytest.raises(fx16.InvalidOptionError, match="unknown metric 'top5'"):
        fx16.cast_fp32_to_fp16(ep, max_rel_error=0.1, metric="top5")


def test_the_command_line_measures_top1_and_exits_3_when_validation_misses(tmp_path):
    _, ep, calibration, validation = _classifier()
    torch.export.save(ep, tmp_path / "classifier.pt2")
    torch.save([validation[2]], tmp_path / "few.pt")  # an input the plain cast flips no row of
    torch.save(calibration, tmp_path / "validation.pt")
    code, out, err = command(
        "cast",
        tmp_path / "classifier.pt2",
        "-o",
        tmp_path / "cast.pt2",
        "--max-rel-error",
        "0",
        "--metric",
        "top1",
        "--calibrate",
        tmp_path / "few.pt",
        "--validate",
        tmp_path / "validation.pt",
    )
    assert code == 3, err
    assert "top1 error 0 on the calibration inputs" in out and "OVER budget" in out
    assert "validation inputs' error" in err
    assert (tmp_path / "cast.pt2").exists()  # written all the same
