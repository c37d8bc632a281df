"""The architecture as a contract: import-linter's contracts in ``pyproject.toml``.

The stages, top to bottom: the command line and the test helpers; the cast functions;
the report; the accuracy budget; the pass lists; the passes; the plan; the analyses;
the caller's choices (``fx16/policy/``); the program; the op tables; the shared
vocabulary. A stage imports only the stages below it, and no package's modules import
each other in a cycle. A wrong import breaks the contract, and the test says which.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parent.parent
LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
)


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_architecture_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        (  # a lower stage importing a higher one
            "ops/numerics.py",
            "from fx16.cli import exits  # noqa: F401",
            "fx16.ops.numerics -> fx16.cli.exits",
        ),
        (  # two modules of one package importing each other
            "ops/tables.py",
            "from fx16.ops import kinds  # noqa: F401",
            "No import cycle among the modules of any package BROKEN",
        ),
    ],
    ids=["upward", "cycle"],
)
def test_a_wrong_import_breaks_the_contract(tmp_path, module, line, broken):
    shutil.copytree(ROOT / "fx16", tmp_path / "fx16", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    wrong = tmp_path / "fx16" / module
    wrong.write_text(wrong.read_text() + f"\n{line}\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout


def test_no_module_is_over_350_lines():
    """Small modules with one job: a module past 350 lines holds more than one."""
    long = {
        str(path.relative_to(ROOT)): count
        for path in (ROOT / "fx16").rglob("*.py")
        if (count := len(path.read_text().splitlines())) > 350
    }
    assert not long, long


def test_the_package_root_holds_at_most_14_modules_and_the_callers_choices_are_one_package():
    """The root holds the entry points and the shared vocabulary; what the caller chose
    (the policy, its tables, the cast's options) is ``fx16/policy/``, one stage."""
    root = sorted(path.name for path in (ROOT / "fx16").glob("*.py"))
    assert len(root) <= 14, root
    assert {"policy.py", "precision.py", "options.py"}.isdisjoint(root)
    choices = {path.name for path in (ROOT / "fx16" / "policy").glob("*.py")}
    assert choices == {"__init__.py", "precision.py", "options.py"}
