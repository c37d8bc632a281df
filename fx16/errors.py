"""The exceptions fx16 raises.

Every failure fx16 reports is an ``Fx16Error``; catching that one type is enough.
The public entry points restore the caller's program before raising (see
``fx16.program.Program.transaction``).
"""

import math


class Fx16Error(Exception):
    """Base class of every error fx16 raises on purpose."""


class InvalidProgramError(Fx16Error, TypeError):
    """The argument is not something fx16 can cast (wrong type, missing metadata)."""


class InvalidOptionError(Fx16Error, ValueError):
    """An option passed to fx16 is malformed or names something the program lacks."""


class PreconditionError(Fx16Error):
    """A pass was run on a graph that lacks what it needs (named in the message)."""


class AccuracyBudgetError(Fx16Error):
    """The accuracy budget cannot be met: even with every value fx16 may return to
    fp32 back in fp32, the outputs differ from fp32 by more than the budget. The
    message gives the error reached and what kept it there."""


class PassFailedError(Fx16Error):
    """A stage of a pipeline raised; the message names the stage.

    It is raised ``from`` the original exception (kept as ``__cause__``). The public
    entry points raise it only after restoring the caller's program (``restored``);
    ``fx16.pipelines.run_passes`` run on its own raises it where the stage failed.
    """

    def __init__(self, stage: str, cause: BaseException, restored: bool = True) -> None:
        after = " The program was left unchanged." if restored else ""
        super().__init__(f"fx16 stage {stage} failed: {one_line(cause)}.{after}")
        self.stage = stage
        self.restored = restored


def one_line(error: BaseException) -> str:
    """``error`` as "Type: the first line of its message" (FX and torch.export append
    tracebacks and advice to theirs)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def require_choice(name: str, value, choices: tuple) -> None:
    """``InvalidOptionError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        said = ", ".join(map(repr, choices))
        raise InvalidOptionError(f"{name} must be one of {said}, not {value!r}")


def require_flag(name: str, value) -> None:
    """``InvalidOptionError`` unless ``value`` is True, False or None (the default)."""
    if value is not None and not isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be True, False or None, got {value!r}")


def require_number(name: str, value, minimum: float, *, strict=False, finite=True, note="") -> None:
    """``InvalidOptionError`` unless ``value`` is a real number (not a bool) >= ``minimum``
    (> with ``strict``), and finite unless ``finite`` is False."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    fits = is_number and (value > minimum if strict else value >= minimum)
    if not (fits and (math.isfinite(value) or not finite)):
        bound = ">" if strict else ">="
        kind = "finite number" if fits else "number"
        raise InvalidOptionError(
            f"{name} must be a {kind} {bound} {minimum:g}{note}, got {value!r}"
        )
