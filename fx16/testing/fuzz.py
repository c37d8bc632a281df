"""``fuzz_pass``: fuzz a pass in one call, and get back the smallest program it breaks.

Hypothesis shrinks a failing random program by trying thousands of variants, each an
export, a pass and a check (about half a second each), for up to five minutes, and
can leave steps in that do not matter. Here the generation stops at the first
failure and the program is reduced step by step instead: each step is dropped in
turn while the pass still fails the same way, so the result needs a few dozen checks
and holds only the steps the failure needs.
"""

import copy
import re
from collections.abc import Callable

from hypothesis import HealthCheck, Phase, given, settings

from fx16.testing.checks import check_pass, quiet
from fx16.testing.strategies import ProgramCase, programs


class PassBroke(AssertionError):
    """A pass broke a random program: the smallest such program and the failure."""


def fuzz_pass(
    make_pass: Callable[[], Callable],
    *,
    max_examples: int = 50,
    strategy=None,
) -> None:
    """Run a fresh ``make_pass()`` on up to ``max_examples`` random programs
    (``strategy``, default ``programs()``), checking each with ``check_pass``. On the
    first failure, reduce that program to the steps the failure needs and raise
    ``PassBroke`` with its steps and the failure (expected and actual values). Any
    failure counts: a check that fails, an invalid result, an exception the pass raises."""
    failures: list[tuple[ProgramCase, AssertionError]] = []

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),  # no shrinking: reduce() does it
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy if strategy is not None else programs())
    def run(case: ProgramCase) -> None:
        error = failure(case, make_pass)
        if error is not None:
            failures.append((case, error))
            raise error

    try:
        run()
    except AssertionError:
        if not failures:
            raise
        case, error = failures[0]
        smallest, error = reduce(case, make_pass, error)
        raise PassBroke(
            f"{error} - on a program of {len(smallest.model.steps)} step(s): "
            f"steps={smallest.model.steps}, width {smallest.args[0].shape[-1]}, "
            f"dynamic={smallest.dynamic}, decompose={smallest.decompose}"
        ) from None


def reduce(
    case: ProgramCase, make_pass: Callable[[], Callable], error: AssertionError
) -> tuple[ProgramCase, AssertionError]:
    """``case`` with every step dropped that the failure does not need: a step goes
    when the program without it still fails with the same kind of message."""
    kind = _kind(error)
    steps = list(case.model.steps)
    index = 0
    while index < len(steps) and len(steps) > 1:
        trial = with_steps(case, steps[:index] + steps[index + 1 :])
        try:
            trial_error = failure(trial, make_pass)
        except Exception:  # the smaller program does not export: keep the step
            trial_error = None
        if trial_error is not None and _kind(trial_error) == kind:
            steps, error = steps[:index] + steps[index + 1 :], trial_error
            continue
        index += 1
    return with_steps(case, steps), error


def failure(case: ProgramCase, make_pass: Callable[[], Callable]) -> AssertionError | None:
    """How a fresh ``make_pass()`` fails ``check_pass`` on ``case``, or None: a failed
    check as it is, an exception the pass raises on the valid program as an
    ``AssertionError`` naming it (the program itself is exported before the pass runs,
    and an export failure propagates)."""
    with quiet():
        original = case.export()
    try:
        check_pass(case, make_pass(), exported=original)
    except AssertionError as error:
        return error
    except Exception as error:
        return AssertionError(f"the pass raised {type(error).__name__}: {error}")
    return None


def _kind(error: AssertionError) -> str:
    """What failed, without the numbers ("integer output N changed at N of N elements")."""
    return re.sub(r"\d+", "N", str(error).split(":")[0])


def with_steps(case: ProgramCase, steps: list) -> ProgramCase:
    """``case`` with its program running ``steps`` (same weights and inputs)."""
    model = copy.deepcopy(case.model)
    model.steps = list(steps)
    return ProgramCase(model, case.args, case.dynamic, case.decompose, case.input_scale)
