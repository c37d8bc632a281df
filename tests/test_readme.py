"""The README's two set-up commands: torch is pinned before anything lets pip choose a
build, and CI (.ci/run) runs the same commands."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    return [line.strip() for line in block.strip().splitlines()]


def test_two_commands_and_torch_pinned_before_the_package():
    install, test = _setup_commands()
    steps = [step.strip() for step in install.split("&&")]
    pinned = next(i for i, step in enumerate(steps) if re.search(r'"torch==[\d.]+"', step))
    package = next(i for i, step in enumerate(steps) if "-e " in step)
    assert pinned < package
    assert steps[-1] == "python -m fx16 demo"
    assert test == "pytest -n 2"


def test_ci_runs_the_readme_commands():
    install, _ = _setup_commands()
    script = (ROOT / ".ci" / "run").read_text()
    torch_pin = re.search(r'"torch==[\d.]+"', install).group(0)
    assert f"python -m pip install -q {torch_pin}" in script
    assert 'python -m pip install -q -e ".[test,coreai]" && python -m fx16 demo' in script
    assert script.rstrip().endswith("python -m pytest -q -n 2")
    assert "python3 -m venv" in script  # a fresh environment, as a new user's


def test_cpu_only_users_are_told_the_cpu_index():
    """PyPI's default torch wheel on Linux is the CUDA build: the README gives the index."""
    readme = (ROOT / "README.md").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme


def test_the_quick_start_runs_as_written():
    """Both quick-start examples (float inputs, token ids) run as the README shows them."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2 and any("input_ids" in block for block in blocks)
    for block in blocks:
        exec(compile(block, "README quick start", "exec"), {})


def test_the_cast_functions_document_every_option_and_error():
    import fx16

    for function in (fx16.cast_fp32_to_fp16, fx16.cast_to_16_bit_precision):
        doc = function.__doc__
        assert "InvalidOptionError" in doc or "Raises as both do" in doc
    doc = fx16.cast_fp32_to_fp16.__doc__
    for word in ("InvalidOptionError", "AccuracyBudgetError", "force_fp32:", "target_share:"):
        assert word in doc, word


def test_the_docs_install_names_an_extra_the_package_has_and_pins_torch_first():
    """``pip install -e ".[docs]"`` once warned "does not provide the extra 'docs'" and
    pulled a CUDA torch: the extra exists, and the README pins torch before it."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(requirement.startswith("mkdocs") for requirement in extras["docs"])
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"`([^`]*\.\[docs\][^`]*)`", readme).group(1)
    steps = [step.strip() for step in command.split("&&")]
    assert re.fullmatch(r'pip install "torch==[\d.]+"', steps[0]), command
    assert steps[-1] == 'pip install -e ".[docs]"'
