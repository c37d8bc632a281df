"""A value's scale is one fact every reader uses: the diagnosis compares a value carried
at 2**e with its fp32 counterpart times 2**e, the report's rows, HTML and layers say it
is scaled, the domain lines name their values, and a saved cast program keeps it all
(its report to the letter, ``fx16 inspect`` of the written file)."""

import contextlib
import io
import json

import torch
from fuzz_profile import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scale_domains import Residual
from torch import nn

import fx16
from fx16 import meta
from fx16.analysis.scale_domains import scale_domains
from fx16.policy import PrecisionPolicy
from fx16.report import format_rows, report_of
from fx16.report.html import report_html
from fx16.testing import programs
from helpers import export, run_fx16

UNIT_ROUNDOFF = 2.0**-11


class LinearReluNorm(nn.Module):
    """Linear (outputs ~5e4, past fp16 over the margin) -> ReLU -> LayerNorm: the
    linear and the ReLU are carried at 2**-k, the norm takes the scale back."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(16, 32), nn.LayerNorm(32)
        with torch.no_grad():
            self.linear.weight.mul_(3e4)

    def forward(self, x):
        return self.norm(torch.relu(self.linear(x)))


def _cast(model, x, **options):
    return fx16.cast_fp32_to_fp16(export(model, x), **options)


def test_the_diagnosis_compares_a_scaled_value_at_its_scale():
    """Input graph: linear -> relu -> layer_norm; the cast carries linear and relu at
    2**-k. Their diagnosed error is 16-bit rounding, not 1 - 2**-k, and no value is
    named a divergence."""
    torch.manual_seed(0)
    model, x = LinearReluNorm().eval(), torch.randn(8, 16)
    cast = _cast(model, x)
    (domain,) = scale_domains(cast.graph_module)
    diagnosis = fx16.diagnose(export(model, x), cast, [(x,)])
    assert diagnosis.first_divergence is None, diagnosis.summary()
    values = diagnosis.by_id()
    for name in ("linear", "relu"):
        assert values[name].scale_exponent == -domain.k
        assert values[name].error < 8 * UNIT_ROUNDOFF
        assert f"at 2**{-domain.k}" in values[name].describe()
    assert all(value.amplification < 8 for value in diagnosis.values)


def test_rows_html_and_layers_say_a_value_is_scaled():
    """Every row of a scaled value says so in its reason (table, HTML title), the
    layer summary counts them, and each domain line names its values."""
    torch.manual_seed(0)
    model, x = Residual(blocks=3).eval(), torch.randn(4, 16)
    cast = _cast(model, x)
    report = report_of(cast)
    scaled = [row for row in report.rows if row.scale_exponent]
    assert scaled
    table = format_rows(report.rows)
    for row in scaled:
        assert f"carried at 2**{row.scale_exponent}" in row.why()
    assert table.count("carried at 2**") == len(scaled)
    page = report_html(report, "residual")
    assert page.count("carried at 2**") >= len(scaled)
    header, *layers = report.by_layer()
    assert "scaled" in header.split()
    assert all(line.split()[-1] == "-" for line in layers)  # nothing fp32: "scaled" is last
    assert sum(int(line.split()[-2]) for line in layers) == len(scaled)
    lines = [line for line in report.summary() if line.startswith("range: scale domain")]
    assert lines and len(set(lines)) == len(lines)
    for line, domain in zip(lines, scale_domains(cast.graph_module), strict=True):
        assert domain.named() in line and domain.values[-1] in line


def test_a_saved_scaled_program_reports_and_diagnoses_as_in_memory(tmp_path):
    """save -> load: the same report JSON (scale exponents, observed ranges, domains,
    casts before, envelope, calibration), and the diagnosis reads the loaded program's
    scales as the in-memory one's."""
    torch.manual_seed(0)
    model, x = LinearReluNorm().eval(), torch.randn(8, 16)
    cast = _cast(model, x)
    expected = report_of(cast).to_json()
    torch.export.save(cast, tmp_path / "cast.pt2")
    for loaded in (torch.export.load(tmp_path / "cast.pt2"), fx16.load(tmp_path / "cast.pt2")):
        assert report_of(loaded).to_json() == expected
        (domain,) = scale_domains(cast.graph_module)
        assert meta.scale_exponent(_named(loaded, "linear")) == -domain.k
        diagnosis = fx16.diagnose(export(model, x), loaded, [(x,)])
        assert diagnosis.first_divergence is None, diagnosis.summary()


def test_a_loaded_cast_program_cast_again_keeps_the_first_casts_figures(tmp_path):
    """The weight bytes and casts before are the fp32 program's, not the 16-bit file's."""
    torch.manual_seed(0)
    model, x = LinearReluNorm().eval(), torch.randn(8, 16)
    first = report_of(_cast(model, x))
    torch.export.save(_cast(model, x), tmp_path / "cast.pt2")
    again = report_of(fx16.cast_fp32_to_fp16(torch.export.load(tmp_path / "cast.pt2")))
    assert again.totals.weight_bytes_before == first.totals.weight_bytes_before
    assert again.totals.weight_bytes_after == first.totals.weight_bytes_after
    assert again.totals.scale_domains == first.totals.scale_domains


def test_inspect_of_a_written_cast_program_reports_what_the_cast_reported(tmp_path):
    """``fx16 cast`` writes a file; ``fx16 inspect`` of it prints the cast's own figures
    (weight bytes halved, the domain line, the envelope), not a re-cast of 16-bit weights."""
    torch.manual_seed(0)
    model, x = LinearReluNorm().eval(), torch.randn(8, 16)
    torch.export.save(export(model, x), tmp_path / "m.pt2")
    cast = run_fx16(["cast", tmp_path / "m.pt2", "-o", tmp_path / "m16.pt2"])
    assert cast.returncode == 0, cast.stderr
    inspected = run_fx16(["inspect", tmp_path / "m16.pt2"])
    assert inspected.returncode == 0, inspected.stderr
    assert "is a program fx16 cast" in inspected.stdout
    said = [line for line in cast.stdout.splitlines() if not line.startswith(("max rel", "wrote"))]
    for line in said:
        assert line in inspected.stdout
    assert "weight bytes: 2432 -> " in inspected.stdout
    assert "range: scale domain" in inspected.stdout


def _named(ep, name):
    return next(node for node in ep.graph_module.graph.nodes if node.name == name)


@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.sampled_from([1e3, 1e5]))
def test_property_scaled_values_diagnose_as_the_unscaled_cast(case, input_scale):
    """Random programs whose inputs push values past fp16's range: wherever the default
    cast and the ``scale_range=False`` cast both compute a value in 16-bit, the default's
    diagnosed error is 16-bit rounding of the same size (never 1 - 2**-k)."""
    args = tuple(a * input_scale if a.is_floating_point() else a for a in case.args)
    calls = [args]
    scaled = fx16.cast_fp32_to_fp16(case.export(), calibration=calls)
    plain = fx16.cast_fp32_to_fp16(
        case.export(), calibration=calls, policy=PrecisionPolicy(scale_range=False)
    )
    reference = case.export()
    default = fx16.diagnose(reference, scaled, calls).by_id()
    unscaled = fx16.diagnose(reference, plain, calls).by_id()
    sixteen = ("float16", "bfloat16")
    for identity, value in default.items():
        other = unscaled.get(identity)
        if other is None or value.dtype not in sixteen or other.dtype not in sixteen:
            continue
        if value.scale_exponent and other.error < 1e-2:
            assert value.error <= 16 * max(other.error, UNIT_ROUNDOFF), (identity, value, other)


@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.sampled_from([1.0, 1e5]))
def test_property_save_load_gives_the_same_report(tmp_path_factory, case, input_scale):
    """save -> load -> report_of gives the in-memory report's JSON, scaled or not, and
    ``fx16 inspect`` of the saved file (run in-process) reports the same: its JSON
    report equal, each summary line printed."""
    from fx16.cli import main

    args = tuple(a * input_scale if a.is_floating_point() else a for a in case.args)
    cast = fx16.cast_fp32_to_fp16(case.export(), calibration=[args])
    expected = report_of(cast).to_json()
    folder = tmp_path_factory.mktemp("saved")
    path, inspected = folder / "cast.pt2", folder / "report.json"
    torch.export.save(cast, path)
    assert report_of(fx16.load(path)).to_json() == expected
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        assert main(["inspect", str(path), "--report", str(inspected)]) == 0
    assert json.loads(inspected.read_text()) == json.loads(expected)
    assert "is a program fx16 cast" in printed.getvalue()
    for line in report_of(cast).summary():
        assert line in printed.getvalue(), line
