"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link, a
missing page or a renamed function in the API reference fails it), the generated
reference pages hold the registries, and the README's demo block is what the demo
prints."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_fx16

ROOT = Path(__file__).resolve().parent.parent


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
    shutil.copytree(ROOT / "docs", tmp_path / "broken" / "docs")
    shutil.copytree(ROOT / "fx16", tmp_path / "broken" / "fx16")
    shutil.copytree(ROOT / "benchmarks", tmp_path / "broken" / "benchmarks")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "broken")
    index = tmp_path / "broken" / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [a page](guide/no-such-page.md).\n")
    broken = _build(tmp_path / "broken", tmp_path / "broken-site")
    assert broken.returncode != 0 and "no-such-page.md" in broken.stderr


def test_the_readme_demo_block_is_what_the_demo_prints():
    """Up to the timing line, which varies from run to run."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```\n(fx16 demo:.*?)```", readme, re.S).group(1).rstrip().splitlines()
    result = run_fx16(["demo"])
    assert result.returncode == 0, result.stderr
    printed = result.stdout.rstrip().splitlines()
    assert block[-1].startswith("weights:") and printed[-1].startswith("weights:")
    assert printed[-len(block) : -1] == block[:-1]
