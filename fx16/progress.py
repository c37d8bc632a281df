"""A one-line progress display on stderr for long steps (calibration, accuracy search)."""

import sys


class Progress:
    """Rewrites one stderr line; silent unless enabled (default: when stderr is a terminal)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._shown = False

    def update(self, message: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r{message}\x1b[K")
            sys.stderr.flush()
            self._shown = True

    def done(self) -> None:
        if self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._shown = False
