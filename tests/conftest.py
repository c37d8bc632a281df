"""Make the repository root importable, so tests can share benchmarks.zoo's models, and
register the hypothesis profiles: "ci" (the default; every property, bounded, derandomized)
and "long"
(``FX16_FUZZ=long``: 10,000 examples per property, or ``FX16_FUZZ_EXAMPLES``; see
fuzz_profile.examples), let ``run_decompositions()`` skip torch's repeated
materialization of composite ops (``tests/cia_materialization.py``), and start every test
from the same random state."""

import os
import sys
from pathlib import Path

import pytest
import torch
from cia_materialization import materialize_only_on_change
from hypothesis import HealthCheck, Phase, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# No "explain" phase: its line tracer, active while torch.export compiles a cond branch
# with dynamo, crashed the interpreter (a segfault) in a long run.
_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
settings.register_profile("ci", derandomize=True, **_COMMON)  # a fixed seed: reproducible
settings.register_profile(
    "long", max_examples=int(os.environ.get("FX16_FUZZ_EXAMPLES", 10_000)), **_COMMON
)
settings.load_profile("long" if os.environ.get("FX16_FUZZ") == "long" else "ci")

# Under pytest-xdist each worker gets one core: torch's intra-op threads would otherwise
# oversubscribe the machine (two workers x two threads on two cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

materialize_only_on_change()


@pytest.fixture(autouse=True)
def _same_random_state():
    """Every test starts from one random state, whichever worker runs it after whichever
    tests: an unseeded draw (``torch.randn(4, 8) * 12``) is the same in CI as here."""
    torch.manual_seed(0)
