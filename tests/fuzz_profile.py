"""How many examples the suite's hypothesis properties draw (see conftest.py)."""

import os

# The hypothesis profile (see conftest.py): "ci" by default, "long" with FX16_FUZZ=long:
# 10,000 examples per property, or FX16_FUZZ_EXAMPLES.
LONG = os.environ.get("FX16_FUZZ") == "long"
LONG_EXAMPLES = int(os.environ.get("FX16_FUZZ_EXAMPLES", 10_000))


def examples(ci: int) -> int:
    """Examples per property: ``ci`` in the ci profile, LONG_EXAMPLES in the long one."""
    return LONG_EXAMPLES if LONG else ci


# Tests marked slow run this many examples: a bounded number by default (and in CI).
SLOW_EXAMPLES = examples(12)
