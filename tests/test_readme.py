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
    assert test == "pytest"


def test_ci_runs_the_readme_commands():
    install, _ = _setup_commands()
    script = (ROOT / ".ci" / "run").read_text()
    torch_pin = re.search(r'"torch==[\d.]+"', install).group(0)
    assert f"python -m pip install -q {torch_pin}" in script
    assert 'python -m pip install -q -e ".[test,coreai]" && python -m fx16 demo' in script
    assert script.rstrip().endswith("python -m pytest -q")
