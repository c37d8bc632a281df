"""``--timings``: the seconds each stage of a command took."""

import sys
import time


class Timings:
    """Seconds per stage, printed on stderr with ``--timings``."""

    def __init__(self, started: float, enabled: bool) -> None:
        self.enabled, self.last = enabled, started
        self.stages: list[tuple[str, float]] = []

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.stages.append((stage, now - self.last))
        self.last = now

    def print(self) -> None:
        if self.enabled:
            total = sum(seconds for _, seconds in self.stages)
            parts = ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in self.stages)
            print(f"fx16 timings: {parts}; total {total:.2f} s", file=sys.stderr)
