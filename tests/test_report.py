"""fx16.report: every recorded decision as rows, JSON and a table."""

import json

import torch

import fx16
from fx16.report import decision_rows, format_rows, report_json
from helpers import export
from models import BucketHash, OverflowWeight


def test_rows_name_every_decision_with_its_reason():
    ep = fx16.cast_fp32_to_fp16(export(OverflowWeight(), torch.randn(2, 4)))
    rows = {row.node: row for row in decision_rows(ep)}
    assert rows["p_big"].dtype == "float32" and not rows["p_big"].narrowed
    assert "exceeds the 16-bit range" in rows["p_big"].reason
    assert rows["p_fc_weight"].narrowed and rows["p_fc_weight"].dtype == "float16"


def test_integer_rows_carry_ranges_and_json_round_trips():
    ep = fx16.cast_int32_to_int16(
        export(BucketHash(), torch.arange(5)), input_ranges={"ids": (0, 999)}
    )
    rows = [row for row in decision_rows(ep) if row.kind == "int"]
    add = next(row for row in rows if row.node == "add")
    assert "exceeds int16" in add.reason and "[0, 999999] (declared)" in add.detail
    assert json.loads(report_json(ep))[0].keys() == {
        "node",
        "op",
        "kind",
        "dtype",
        "narrowed",
        "reason",
        "detail",
    }
    table = format_rows(rows)
    assert table.splitlines()[0].split() == ["node", "op", "dtype", "why"]
    assert len(table.splitlines()) == len(rows) + 1
