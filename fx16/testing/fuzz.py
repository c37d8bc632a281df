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
from collections import Counter
from collections.abc import Callable, Collection

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch.fx import GraphModule

from fx16.testing.checks import check_pass, quiet
from fx16.testing.random_programs import MENU
from fx16.testing.strategies import ProgramCase, programs, sweep_cases

# the input scale of the second sweep: linear layers of unit weights reach 1e5
LOUD = 1e5


class PassBroke(AssertionError):
    """A pass broke a random program: the smallest such program and the failure."""


def fuzz_pass(
    make_pass: Callable[[], Callable],
    *,
    max_examples: int = 50,
    strategy=None,
    seed: int | None = None,
    touches: Collection[str] | None = None,
) -> None:
    """Run a fresh ``make_pass()`` on up to ``max_examples`` random programs, checking
    each with ``check_pass``. On the first failure, reduce that program to the steps
    the failure needs and raise ``PassBroke`` with its steps and the failure (expected
    and actual values). Any failure counts: a check that fails, an invalid result, an
    exception the pass raises, a rewritten program that fails to run.

    The draw leans toward the ops the pass touches, since a pass that rewrites one op
    family breaks only the programs that hold it, and a random program holds a given
    op rarely: ``touches`` (or the pass class's ``touches`` attribute) names them as
    menu entries of ``fx16.testing.programs`` ("gelu", "layer_norm"); otherwise a sweep
    comes first, a few programs that hold every menu entry between them
    (``sweep_cases``, each checked too), and the entries of those the pass changes
    (the node targets it leaves differ) are the focus, swept once more one to a
    program on inputs of ``LOUD`` (1e5: a pass that narrows to 16-bit what overflows
    shows there). Half of the random programs are
    drawn from the focus, half from the whole menu; ``strategy`` replaces both draws
    (and the sweep). ``seed`` makes the random draw reproducible (None: hypothesis
    picks one). To narrow the menu by hand, pass
    ``strategy=fx16.testing.programs(menu=("gelu", "linear"))``."""
    declared = touches if touches is not None else getattr(make_pass, "touches", None)
    probing = declared is None and strategy is None
    first = _fuzz_phase(make_pass, max_examples, strategy, seed, declared, probing)
    if first is not None:
        _raise_reduced(make_pass, *first)


def _fuzz_phase(make_pass, max_examples, strategy, seed, focus, probing: bool):
    """The first failure, as (case, error), or None. ``probing``: first the sweep
    (``sweep_cases``: every menu entry in a few programs), whose programs the pass
    changes name the focus."""
    changed: list[set[str]] = []
    failures: list[tuple[ProgramCase, AssertionError]] = []
    whole = strategy if strategy is not None else programs()

    def check(case: ProgramCase) -> None:
        error = failure(case, make_pass, changed)
        if error is not None:
            failures.append((case, error))
            raise error

    if probing:
        for case in sweep_cases():
            try:
                check(case)
            except AssertionError:
                return failures[0]
        focus = sorted(set().union(*changed)) if changed else None
        # the entries it changes again, one to a program (each reads the input itself),
        # on inputs past fp16's range: a pass that narrows what overflows breaks there
        for case in sweep_cases(menu=tuple(focus or ()), steps_each=1, input_scale=LOUD):
            try:
                check(case)
            except AssertionError:
                return failures[0]
    menu = tuple(name for name in (focus or ()) if name in MENU)
    draw = st.one_of(programs(menu=menu), whole) if menu and strategy is None else whole
    runner = settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),  # no shrinking: reduce() does it
        suppress_health_check=list(HealthCheck),
    )(given(draw)(check))
    if seed is not None:
        runner = hypothesis_seed(seed)(runner)
    try:
        runner()
    except AssertionError:
        if not failures:
            raise
    return failures[0] if failures else None


def _raise_reduced(make_pass, case: ProgramCase, error: AssertionError) -> None:
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


def failure(
    case: ProgramCase, make_pass: Callable[[], Callable], changed: list | None = None
) -> AssertionError | None:
    """How a fresh ``make_pass()`` fails ``check_pass`` on ``case``, or None: a failed
    check as it is, an exception the pass raises on the valid program as an
    ``AssertionError`` naming it (the program itself is exported before the pass runs,
    and an export failure propagates). ``changed``: where the pass changes the node
    targets of the program, its steps' menu entries are appended to it."""
    with quiet():
        original = case.export()
    graph_pass = make_pass()

    def recorded(graph_module):
        before = _targets(graph_module)
        result = graph_pass(graph_module)
        if changed is not None and _targets(graph_module) != before:
            changed.append({step[0] for step in case.model.steps})
        return result

    try:
        check_pass(case, recorded, exported=original)
    except AssertionError as error:
        return error
    except Exception as error:
        return AssertionError(f"the pass raised {type(error).__name__}: {error}")
    return None


def _targets(graph_module) -> Counter:
    return Counter(
        str(node.target)
        for module in graph_module.modules()
        if isinstance(module, GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function"
    )


def _kind(error: AssertionError) -> str:
    """What failed, without the numbers ("integer output N changed at N of N elements")."""
    return re.sub(r"\d+", "N", str(error).split(":")[0])


def with_steps(case: ProgramCase, steps: list) -> ProgramCase:
    """``case`` with its program running ``steps`` (same weights and inputs)."""
    model = copy.deepcopy(case.model)
    model.steps = list(steps)
    return ProgramCase(model, case.args, case.dynamic, case.decompose, case.input_scale)
