"""The fx16 command, run as a user runs it: through a subprocess."""

import hashlib
import json
import subprocess
import sys
import zipfile

import pytest
import torch

from helpers import export
from models import MLP


def fx16(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fx16", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """An MLP saved as .pt2, and a file of calibration inputs."""
    folder = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    path = folder / "mlp.pt2"
    torch.export.save(export(MLP(), torch.randn(4, 8)), path)
    inputs = folder / "inputs.pt"
    torch.save([(torch.randn(4, 8),) for _ in range(3)], inputs)
    return path, inputs


def test_cast_writes_a_loadable_fp16_program_and_a_summary(program, tmp_path):
    source, _ = program
    before = _digest(source)
    target = tmp_path / "mlp16.pt2"
    result = fx16("cast", source, "-o", target, "--report", tmp_path / "report.json")
    assert result.returncode == 0, result.stderr
    assert "weight bytes:" in result.stdout and "(0.50x)" in result.stdout
    assert "max relative error vs fp32:" in result.stdout
    loaded = torch.export.load(target)
    assert {t.dtype for t in loaded.state_dict.values()} == {torch.float16}
    assert loaded.module()(torch.randn(4, 8).half()).dtype == torch.float16
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["totals"]["weight_bytes_after"] * 2 == report["totals"]["weight_bytes_before"]
    assert _digest(source) == before


def test_dry_run_writes_nothing(program, tmp_path):
    source, _ = program
    result = fx16(
        "cast", source, "-o", tmp_path / "out.pt2", "--dry-run", "--policy", "auto_mixed_bf16"
    )
    assert result.returncode == 0, result.stderr
    assert "bfloat16" in result.stdout
    assert not (tmp_path / "out.pt2").exists()


@pytest.mark.parametrize("setting, rule", [("keep", "explicit_fp32"), ("retarget", None)])
def test_explicit_fp32_setting(tmp_path, setting, rule):
    """--explicit-fp32 reaches the policy: an RMSNorm's fp32 region kept, or made fp16."""
    from models import RMSNormMLP

    source = tmp_path / "norm.pt2"
    torch.export.save(export(RMSNormMLP(), torch.randn(3, 16)), source)
    report = tmp_path / "report.json"
    result = fx16(
        "cast", source, "-o", tmp_path / "out.pt2", "--explicit-fp32", setting, "--report", report
    )
    assert result.returncode == 0, result.stderr
    rules = {row["rule"] for row in json.loads(report.read_text())["nodes"]}
    assert (rule in rules) if rule else not rules & {"explicit_fp32"}


def test_calibration_file_and_accuracy_budget(program, tmp_path):
    source, inputs = program
    result = fx16(
        "cast",
        source,
        "-o",
        tmp_path / "out.pt2",
        "--calibrate",
        inputs,
        "--max-rel-error",
        "0.05",
        "--keep-io-types",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""  # --quiet: no summary, no progress
    loaded = torch.export.load(tmp_path / "out.pt2")
    assert loaded.module()(torch.randn(4, 8)).dtype == torch.float32  # io types kept


def test_inspect_explains_without_writing(program, tmp_path):
    source, _ = program
    result = fx16("inspect", source, "--all", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split()[:5] == ["node", "op", "dtype", "rule", "why"]
    assert "float ops in 16-bit" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_compare_shows_both_dtypes(program, tmp_path):
    source, inputs = program
    target = tmp_path / "mlp16.pt2"
    assert fx16("cast", source, "-o", target, "--quiet").returncode == 0
    result = fx16("compare", source, target, "--inputs", inputs)
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()[1:]
    assert len(rows) == 3 and all("float32    float16" in row for row in rows)


def _bad_inputs(folder, source):
    (folder / "notes.txt").write_text("not a program")
    with zipfile.ZipFile(folder / "corrupt.pt2", "w") as archive:
        archive.writestr("corrupt/data.pkl", b"junk")
    return {
        "missing": (["cast", folder / "missing.pt2", "-o", folder / "x.pt2"], "does not exist"),
        "not a pt2": (["cast", folder / "notes.txt", "-o", folder / "x.pt2"], "not a .pt2"),
        "corrupt": (["cast", folder / "corrupt.pt2", "-o", folder / "x.pt2"], "cannot load"),
        "overwrite": (["cast", source, "-o", source], "--force"),
        "policy": (
            ["cast", source, "-o", folder / "x.pt2", "--policy", "fastest"],
            "unknown policy",
        ),
        "directory": (["cast", source, "-o", folder / "no" / "x.pt2"], "does not exist"),
    }


@pytest.mark.parametrize(
    "case", ["missing", "not a pt2", "corrupt", "overwrite", "policy", "directory"]
)
def test_bad_input_is_one_line_and_changes_nothing(program, tmp_path, case):
    source, _ = program
    before = _digest(source)
    arguments, words = _bad_inputs(tmp_path, source)[case]
    result = fx16(*arguments)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("fx16:")]
    assert len(lines) == 1 and words in lines[0]
    assert "Traceback" not in result.stderr
    assert _digest(source) == before
    assert not (tmp_path / "x.pt2").exists()


def test_overwrite_with_force(program, tmp_path):
    source, _ = program
    copy = tmp_path / "copy.pt2"
    copy.write_bytes(source.read_bytes())
    result = fx16("cast", copy, "-o", copy, "--force", "--quiet")
    assert result.returncode == 0, result.stderr
    assert {t.dtype for t in torch.export.load(copy).state_dict.values()} == {torch.float16}


def test_demo_and_console_script():
    result = fx16("demo")
    assert result.returncode == 0 and "max relative error" in result.stdout
    help_text = subprocess.run(["fx16", "--help"], capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "cast" in help_text.stdout
