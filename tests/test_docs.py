"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link, a
missing page or a renamed function in the API reference fails it), the generated
reference pages hold the registries, and the README's demo block is what the demo
prints."""

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_fx16

ROOT = Path(__file__).resolve().parent.parent


def _text(page: str) -> str:
    """A page's text, tags dropped and white space folded."""
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root), "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)


def test_the_site_builds_strict_with_the_generated_pages(tmp_path):
    pytest.importorskip("mkdocstrings")
    result = _build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    rules = (tmp_path / "site" / "reference" / "rules" / "index.html").read_text()
    for rule in ("UnsafeIndexRule", "RmsNormScaling", "FuseCastChainsPass", "safety_rule"):
        assert rule in rules
    options = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--max-rel-error" in options and "--per-node" in options
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "cast_fp32_to_fp16" in api and "InvalidOptionError" in api
    # the cast's options as a parameter table, its signature keyword by keyword (once
    # one paragraph under a signature of ``**options``)
    cast = _text(api.split('id="fx16.casting.cast_fp32_to_fp16"', 1)[1])
    cast = cast.split('id="fx16.casting.cast_int32_to_int16"', 1)[0]
    assert "overflow_margin = 2.0" in cast and "**options" not in cast.replace(" ", "")
    assert "Parameters: Name Type Description Default" in cast
    assert "overflow_margin float a value counts as overflowing" in cast
    raises = (
        "Raises: Type Description InvalidProgramError exported_program is not an ExportedProgram"
    )
    assert raises in cast
    shutil.copytree(ROOT / "docs", tmp_path / "broken" / "docs")
    shutil.copytree(ROOT / "fx16", tmp_path / "broken" / "fx16")
    shutil.copytree(ROOT / "benchmarks", tmp_path / "broken" / "benchmarks")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "broken")
    index = tmp_path / "broken" / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [a page](guide/no-such-page.md).\n")
    broken = _build(tmp_path / "broken", tmp_path / "broken-site")
    assert broken.returncode != 0 and "no-such-page.md" in broken.stderr


def test_the_readme_demo_block_is_what_the_demo_prints():
    """Up to the timing line, which varies from run to run; the errors against fp64 to
    within a factor of 1.5: their digits may depend on the CPU's kernels."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```\n(fx16 demo:.*?)```", readme, re.S).group(1).rstrip().splitlines()
    result = run_fx16(["demo"])
    assert result.returncode == 0, result.stderr
    printed = result.stdout.rstrip().splitlines()[-len(block) :]
    assert block[-1].startswith("weights:") and printed[-1].startswith("weights:")
    label = "max relative error vs fp64"
    assert [line for line in printed[:-1] if not line.startswith(label)] == [
        line for line in block[:-1] if not line.startswith(label)
    ]
    shown, measured = (_errors(lines, label) for lines in (block, printed))
    assert len(shown) == len(measured) == 2
    for expected, found in zip(shown, measured, strict=True):
        assert expected / 1.5 <= found <= expected * 1.5


def _errors(lines: list[str], label: str) -> list[float]:
    """The figures on the line of ``lines`` that starts with ``label``."""
    (line,) = [line for line in lines if line.startswith(label)]
    return [float(figure) for figure in line[len(label) :].split()]
