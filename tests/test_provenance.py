"""The report's provenance: what made a cast, as JSON values."""

import json

import torch

import fx16
from fx16 import PrecisionPolicy
from fx16.report import report_of
from helpers import export
from models import MLP


def test_the_json_says_how_to_make_the_same_cast_again():
    torch.manual_seed(0)
    policy = PrecisionPolicy.auto_mixed_conservative(modules={"layers.1": "fp32"})
    calibration = [(torch.randn(4, 8),) for _ in range(3)]
    ep = fx16.cast_fp32_to_fp16(
        export(MLP(), torch.randn(4, 8)), policy=policy, calibration=calibration, force_fp32="gelu"
    )
    made_by = json.loads(report_of(ep).to_json())["provenance"]
    assert made_by["entry_point"] == "cast_fp32_to_fp16"
    assert made_by["torch"] == torch.__version__ and made_by["fx16"]
    options = made_by["options"]
    assert options["calibration"] == "3 input(s)" and options["force_fp32"] == ["gelu"]
    assert options["policy"]["name"] == "auto_mixed_conservative"
    assert options["policy"]["kinds"]["reduction"] == "fp32"
    assert options["policy"]["modules"] == {"layers.1": "fp32"}
    assert options["max_rel_error"] is None and options["overflow_margin"] == 2.0
