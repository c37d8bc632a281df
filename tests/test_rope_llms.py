"""Rotary LLMs exported for devices (a static cache of 2048), both export modes: decode
steps at positions 1500-2040, with peaked attention, stay within 5e-3 of fp32 (the eager
module that was exported).

Non-strict export (torch.export's default) puts the rotary embedding, computed under
``torch.no_grad()``, in a ``wrap_with_set_grad_enabled`` body: the inv_freq buffer
outside must stay fp32 for the angles inside to be right.
"""

import pytest
import torch

import fx16
from benchmarks.precision_zoo import ROPE_LLMS, decode_outputs, rope_llm
from fx16.analysis.fp32_rules import ConditioningRule
from fx16.pipelines import run_passes, without_rules
from fx16.program import Program
from fx16.program.stats import relative_error


def _decode_errors(step, cast) -> list[float]:
    return [relative_error(want, got.float()) for want, got in decode_outputs(step, cast)]


def _export(step, strict):
    example = {"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([0])}
    return torch.export.export(step, (), example, strict=strict)


@pytest.mark.slow
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("name", ROPE_LLMS)
def test_decode_at_positions_1500_to_2040_stays_within_5e_3(name, strict):
    step = rope_llm(name)
    cast = fx16.cast_fp32_to_fp16(_export(step, strict))
    assert max(_decode_errors(step, cast)) <= 5e-3
    report = fx16.report.report_of(cast)
    assert report.totals.flop_share_16bit == 1.0  # the angles cost no product FLOPs
    used = [row for row in report.rows if "inv_freq" in row.node and "original" not in row.node]
    inv_freq = used  # the buffer and, in a body, the placeholder it becomes
    assert inv_freq and all(row.dtype == "float32" for row in inv_freq)


@pytest.mark.slow
@pytest.mark.parametrize("strict", [False, True])
def test_without_the_conditioning_rule_qwen3_loses_its_angles(strict):
    """What the rule buys: the same cast with it taken out misses the bound."""
    step = rope_llm("qwen3")
    cast = _export(step, strict)
    with Program(cast).transaction():
        run_passes(without_rules(fx16.fp16_passes(cast), ConditioningRule), cast.graph_module)
    assert max(_decode_errors(step, cast)) > 5e-3
