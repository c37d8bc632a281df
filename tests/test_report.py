"""fx16.report: every recorded decision as rows, JSON and a table."""

import copy
import gc
import json
import weakref

import pytest
import torch

import fx16
from fx16.policy import PrecisionPolicy
from fx16.report import REPORT_KEY, format_rows, report_of
from fx16.report.rows import decision_rows
from helpers import export
from models import (
    BucketHash,
    CumsumCounter,
    GrowingLoop,
    OverflowWeight,
    RMSNormMLP,
    ScaleShiftChain,
)

# a weight past fp16 on the fp32 path (scale domains would fold it into fp16)
NO_SCALING = PrecisionPolicy(scale_range=False, explicit_fp32="calibrated")


def test_rows_name_every_decision_with_its_reason():
    ep = fx16.cast_fp32_to_fp16(export(OverflowWeight(), torch.randn(2, 4)), policy=NO_SCALING)
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
    first = json.loads(report_of(ep).to_json())["nodes"][0]
    assert first.keys() == {
        "node",
        "op",
        "kind",
        "dtype",
        "narrowed",
        "rule",
        "reason",
        "detail",
        "module",
        "flops",
        "product",
        "bytes",
        "observed",
        "observed_max_abs",
        "proven",
        "condition_number",
        "cast_back_skipped",
        "stabilized",
        "chosen_by",
        "scale_exponent",
        "sentinel_fill",
    }
    assert add_row(report_of(ep))["proven"] == [0, 999999]  # numbers, not only text
    table = format_rows(rows)
    header = ["node", "module", "op", "dtype", "rule", "fp32-cost", "why"]
    assert table.splitlines()[0].split() == header
    assert len(table.splitlines()) == len(rows) + 1


def test_every_cast_stores_a_report_whose_json_has_a_reason_for_every_wide_node():
    torch.manual_seed(0)
    ep = fx16.cast_to_16_bit_precision(
        export(OverflowWeight(), torch.randn(2, 4)), calibration=[(torch.randn(2, 4),)]
    )
    report = report_of(ep)
    document = json.loads(report.to_json())
    assert set(document) == {"provenance", "totals", "nodes"}
    assert set(document["totals"]) == {
        "weight_bytes_before",
        "weight_bytes_after",
        "casts_before",
        "casts_after",
        "casts_inserted",
        "model_casts_removed",
        "float_ops",
        "float_ops_16bit",
        "share_16bit",
        "product_flops",
        "product_flops_16bit",
        "flop_share_16bit",
        "cast_bytes",
        "fp32_weight_bytes",
        "envelope",
        "scale_domains",
    }
    envelope = document["totals"]["envelope"]
    assert envelope["calibration"] == "observed on 1 input(s)" and envelope["margin"] == 2.0
    for node in document["nodes"]:
        assert node["reason"] and node["rule"]
        if node["kind"] == "float" and node["dtype"] != "float16":
            assert node["rule"] != "fits"
    totals = report.totals
    assert totals.weight_bytes_after < totals.weight_bytes_before
    assert 0 < totals.share_16bit < 1
    assert "float ops in 16-bit" in report.table()


def test_report_of_an_uncast_program_is_none():
    assert report_of(export(OverflowWeight(), torch.randn(2, 4))) is None


def test_bodies_of_higher_order_ops_have_rows_too():
    torch.manual_seed(0)
    ep = fx16.cast_fp32_to_fp16(export(GrowingLoop().eval(), torch.randn(2, 8)))
    rows = {row.node: row for row in report_of(ep).rows}
    linear = rows["while_loop_body_graph_0.linear"]
    assert linear.dtype == "float16" and linear.rule == "fits"
    assert rows["while_loop_body_graph_0.arg1_1"].rule == "loop_carried"
    assert all(row.rule != "left_as_is" for row in rows.values() if row.kind == "float")


class LongNames(torch.nn.Module):
    """Two layers whose node names share their first 24 characters."""

    def __init__(self):
        super().__init__()
        self.encoder_layer_with_a_long_name = torch.nn.ModuleList(
            torch.nn.Linear(4, 4) for _ in range(2)
        )

    def forward(self, x):
        for layer in self.encoder_layer_with_a_long_name:
            x = layer(x).relu()
        return x


def test_the_table_shows_full_names_and_modules_and_a_summary_per_layer():
    ep = fx16.cast_fp32_to_fp16(export(LongNames(), torch.randn(2, 4)))
    report = report_of(ep)
    table = report.table()
    names = [row.node for row in report.rows]
    assert len({name[:24] for name in names}) < len(names)  # the old table's cut
    for name in names:
        assert f"{name} " in table
    assert "encoder_layer_with_a_long_name.1" in table
    layers = report.by_layer()
    assert layers[0].split()[:5] == ["layer", "FLOPs", "16-bit", "16-bit", "fp32"]
    assert layers[1].split()[1] == "100%"  # the first layer's linear is 16-bit
    assert [line.split()[0] for line in layers[1:]] == [
        "encoder_layer_with_a_long_name.0",
        "encoder_layer_with_a_long_name.1",
        "(no",  # the user input
    ]


def test_a_pipeline_of_fx16_passes_has_a_report_too():
    """PassManager(fx16.fp16_passes(ep)) stores no report: report_of builds one from the
    decisions in the nodes' meta and the figures RecordStatsPass kept of the program
    before the pipeline, the same as the cast function's (the model's own casts
    counted before: not "casts: 0 -> 0")."""
    from torch.fx.passes.infra.pass_manager import PassManager

    for model, width in ((OverflowWeight, 4), (RMSNormMLP, 16)):
        torch.manual_seed(0)
        by_function = fx16.cast_fp32_to_fp16(
            export(model(), torch.randn(2, width)), policy=NO_SCALING
        )
        torch.manual_seed(0)
        by_manager = export(model(), torch.randn(2, width))
        PassManager(fx16.fp16_passes(by_manager, policy=NO_SCALING))(by_manager.graph_module)
        built, stored = report_of(by_manager), report_of(by_function)
        assert built is not None and built.rows == stored.rows
        assert built.totals == stored.totals
        assert built.summary() == stored.summary()
    assert stored.totals.casts_before > 0 and stored.totals.model_casts_removed > 0


def _decision(row) -> tuple:
    return row.node, row.op, row.dtype, row.rule, row.reason, row.detail


def add_row(report) -> dict:
    return next(row for row in json.loads(report.to_json())["nodes"] if row["node"] == "add")


def test_a_second_cast_keeps_the_first_casts_figures():
    """Casting an already cast program again reports the weights against the original
    (0.52x: half the weights' bytes and the stable norm's twelve 16-bit constants, not
    1.00x) and keeps the accuracy search the first cast ran."""
    torch.manual_seed(0)
    ep = export(RMSNormMLP(), torch.randn(2, 16))
    fx16.cast_fp32_to_fp16(ep, max_rel_error=0.05, explicit_fp32="calibrated")
    first = report_of(ep)
    fx16.cast_fp32_to_fp16(ep, explicit_fp32="calibrated")
    second = report_of(ep)
    assert second.totals == first.totals
    assert [_decision(row) for row in second.rows] == [_decision(row) for row in first.rows]
    assert second.accuracy == first.accuracy is not None
    weights = [line for line in second.summary() if line.startswith("weight bytes")]
    assert weights == [line for line in first.summary() if line.startswith("weight bytes")]
    assert weights == ["weight bytes: 1152 -> 600 (0.52x)"]


class ScoresBeyondFp16(torch.nn.Module):
    """q @ k^T whose scores reach ~1e5: the range rule keeps the product in fp32."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.out = (torch.nn.Linear(16, 16) for _ in range(3))
        with torch.no_grad():
            self.q.weight.mul_(150.0)
            self.k.weight.mul_(150.0)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.out(scores.softmax(-1) @ x)


def test_the_summary_opens_with_the_16_bit_flop_share_and_fp32_rows_state_their_cost():
    """Input: linears and a bmm whose scores overflow fp16. Output: the bmm in fp32 -
    the FLOP share below 100% by exactly its FLOPs, its row's cost naming them."""
    from fx16.program.cost import flops

    torch.manual_seed(0)
    ep = fx16.cast_fp32_to_fp16(export(ScoresBeyondFp16(), torch.randn(2, 8, 16)))
    report = report_of(ep)
    wide = [row for row in report.rows if row.product and not row.narrowed]
    assert [row.rule for row in wide] == ["activation_overflow"]
    assert wide[0].cost() == f"{wide[0].flops / 1e3:.3g} kFLOPs (matmul/conv/attention)"
    bmm = next(n for n in ep.graph_module.graph.nodes if n.name == wide[0].node)
    assert wide[0].flops == flops(bmm) == 2 * 2 * 8 * 8 * 16
    totals = report.totals
    assert totals.product_flops - totals.product_flops_16bit == wide[0].flops
    assert report.summary()[0].startswith("matmul/conv/attention FLOPs in 16-bit: ")
    assert f"{totals.flop_share_16bit:.2%}" in report.summary()[0]
    assert "fp32-cost" in report.table(wide)


def test_a_program_without_products_says_so_instead_of_a_share_of_zero():
    """x * 2 + 1: no matmul, conv or attention; the headline once read "100.00% of 0"."""
    ep = fx16.cast_fp32_to_fp16(export(ScaleShiftChain(2, 2.0, 1.0), torch.randn(4, 8)))
    assert report_of(ep).summary()[0] == "matmul/conv/attention FLOPs: none in this program"


class NoGradAngles(torch.nn.Module):
    """Rotary-style angles under ``torch.no_grad()``: export puts them in a
    ``wrap_with_set_grad_enabled`` body, where cos of positions up to 2047 stays fp32."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, positions):
        with torch.no_grad():
            angles = positions.float()[:, None] * self.inv_freq
            rotation = torch.cat([angles.cos(), angles.sin()], dim=-1)
        return self.fc(x) * rotation


def test_the_totals_count_the_ops_inside_higher_order_op_bodies():
    """The summary's float ops and casts include a body's: the rotary body's fp32 ops
    are not "16-bit: 100%"."""
    positions = torch.arange(2000, 2048)
    ep = torch.export.export(NoGradAngles(), (torch.randn(48, 8), positions))
    bodies = [m for name, m in ep.graph_module.named_modules() if name]
    assert bodies  # the set_grad_enabled body
    fx16.cast_fp32_to_fp16(ep)
    report = report_of(ep)
    in_bodies = [
        row
        for row in report.rows
        if row.kind == "float"
        and "." in row.node
        and row.op not in ("placeholder", "getitem", "to.dtype", "_to_copy.default")
    ]
    wide = [row for row in in_bodies if not row.narrowed]
    assert wide  # cos/sin of large angles kept fp32 inside the body
    totals = report.totals
    assert totals.float_ops - totals.float_ops_16bit >= len(wide)
    assert totals.casts_inserted >= 1
    assert f"of {totals.float_ops} (" in "\n".join(report.summary())


def test_rows_name_ops_plainly_and_integers_never_considered_are_left_out_of_why():
    """Inputs are "input", weights "parameter", getitem "getitem"; ``explained()`` (what
    inspect lists) leaves out integers outside the castable set (positions, index
    computations, constant-foldable values) and keeps the refused candidates."""
    from models import PositionsAndMask

    ids, mask = torch.randint(0, 100, (2, 6)), torch.ones(2, 6, dtype=torch.bool)
    report = report_of(fx16.cast_to_16_bit_precision(export(PositionsAndMask(), ids, mask)))
    ops = {row.node: row.op for row in report.rows}
    assert ops["ids"] == "input" and ops["p_embed_weight"] == "parameter"
    assert "<built-in" not in " ".join(ops.values())
    explained = report.explained()
    outside = [row for row in report.rows if row.rule in ("not_user_reachable", "unsafe_index")]
    assert outside and not [row for row in outside if row in explained]
    refused = report_of(
        fx16.cast_to_16_bit_precision(export(CumsumCounter(), torch.arange(6), torch.arange(6)))
    )
    assert [row for row in refused.explained() if row.kind == "int"]  # range_unknown rows


def test_the_stored_report_keeps_no_weight_alive_and_a_read_one_holds_its_program():
    """torch keeps the graph it traced last (and its graph module's meta, where the report
    lives) after the caller drops the program: the stored report refers to the program
    weakly, so the weights are freed; a report from ``report_of`` holds its program until
    it is built, so ``report_of(fx16.cast_fp32_to_fp16(export(...))).rows`` works."""
    ep = fx16.cast_fp32_to_fp16(export(RMSNormMLP(), torch.randn(2, 16)))
    stored = ep.graph_module.meta[REPORT_KEY]
    read = report_of(ep)
    weights = [weakref.ref(tensor) for tensor in ep.state_dict.values()]
    del ep
    gc.collect()
    assert any(weight() is not None for weight in weights)  # the read report holds it
    rows = read.rows
    assert rows and read.totals.float_ops_16bit > 0
    del read
    gc.collect()
    assert all(weight() is None for weight in weights)
    assert stored.rows == rows  # built once, shared with the stored report
    unread = fx16.cast_fp32_to_fp16(export(RMSNormMLP(), torch.randn(2, 16)))
    stored = unread.graph_module.meta[REPORT_KEY]
    weights = [weakref.ref(tensor) for tensor in unread.state_dict.values()]
    del unread
    gc.collect()
    assert all(weight() is None for weight in weights)  # a cast no one read the report of
    with pytest.raises(ReferenceError, match="freed before the report was first read"):
        stored.built()


def test_a_deep_copy_of_a_cast_program_reports_the_copy():
    ep = fx16.cast_fp32_to_fp16(export(RMSNormMLP(), torch.randn(2, 16)))
    copied = copy.deepcopy(ep)
    assert copied.graph_module.meta[REPORT_KEY].source.program() is copied
    expected = [row.node for row in report_of(ep).rows]
    del ep
    gc.collect()
    assert [row.node for row in report_of(copied).rows] == expected


def test_the_report_survives_save_and_load(tmp_path):
    """A saved cast program keeps each node's decision, the facts its report reads
    (what calibration observed, the figures before the cast) and the report's
    provenance: ``report_of`` of the loaded program (by ``torch.export.load`` or
    ``fx16.load``) gives the same report, to the letter of its JSON."""
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    ep = fx16.cast_to_16_bit_precision(export(RMSNormMLP(), x), calibration=[(x,), (x * 2,)])
    before = report_of(ep)
    torch.export.save(ep, tmp_path / "cast.pt2")
    for loaded in (torch.export.load(tmp_path / "cast.pt2"), fx16.load(tmp_path / "cast.pt2")):
        after = report_of(loaded)
        assert after is not None and after.provenance == json.loads(json.dumps(before.provenance))
        assert after.to_json() == before.to_json()
        assert any(row.observed is not None for row in after.rows)
    fp32 = tmp_path / "fp32.pt2"
    torch.export.save(export(RMSNormMLP(), x), fp32)
    assert report_of(torch.export.load(fp32)) is None and report_of(fx16.load(fp32)) is None
