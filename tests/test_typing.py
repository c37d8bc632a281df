"""The public API is typed for checkers: the lazily loaded names have their real
signatures, and a misspelled option or a wrong type is a type error."""

import os
import subprocess
import sys
import textwrap

from helpers import CHECKOUT

USER_SCRIPT = textwrap.dedent(
    """
    import torch

    import fx16

    ep = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    fx16.cast_fp32_to_fp16(ep, overflow_margin=4.0, policy="auto_mixed")
    fx16.cast_fp32_to_fp16(ep, overflow_margin="two")
    fx16.cast_fp32_to_fp16(ep, overflow_margn=4.0)
    args, kwargs = fx16.inputs_for(ep, torch.randn(1, 2))
    policy: fx16.PrecisionPolicy = fx16.PrecisionPolicy.custom(kinds={"reduction": "fp32"})
    """
)


def test_mypy_sees_the_signatures_behind_the_lazy_names(tmp_path):
    """Once ``fx16.cast_fp32_to_fp16`` was ``Any`` to mypy (the module's ``__getattr__``),
    so ``overflow_margin="two"`` and a misspelled keyword passed: both are errors now,
    and the correct calls are not."""
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-incremental", str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(CHECKOUT)},
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, result.stdout + result.stderr
    assert 'user.py:8: error: Argument "overflow_margin"' in errors[0]
    assert 'user.py:9: error: Argument "overflow_margn"' in errors[1]


def test_the_package_says_it_is_typed():
    assert (CHECKOUT / "fx16" / "py.typed").is_file()
