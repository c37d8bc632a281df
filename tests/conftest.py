"""Make the repository root importable, so tests can share benchmarks.zoo's models."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
