"""The checks fx16 holds its own passes to, for any pass over an exported program.

``check_valid_program`` is what a downstream user does with a program: lint,
validate, save and load, decompose, run, and every node's recorded dtype is the one
it computes. ``check_pass`` applies a pass to a fresh export of a random program and
asserts, beyond validity, that integer outputs stay bit-exact, that no inf or nan
appears where the original program's outputs are finite, and that float outputs stay
within the float oracle's bound (``fx16.testing.oracle``).
"""

import contextlib
import copy
import io
import logging
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.fx import GraphModule

from fx16.errors import one_line
from fx16.ops.numerics import INF_LIKE
from fx16.program import Program
from fx16.testing.oracle import check_floats


def check_valid_program(ep: ExportedProgram) -> None:
    """Lint, validate, save/load (same outputs), decompose, and the recorded dtypes of
    every node match what running the graph gives (on the recorded example inputs)."""
    ep.graph_module.graph.lint()
    ep.validate()
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    if ep.example_inputs is not None:
        args, kwargs = ep.example_inputs
        expected = pytree.tree_leaves(ep.module()(*args, **kwargs))
        got = pytree.tree_leaves(loaded.module()(*args, **kwargs))
        for a, b in zip(expected, got):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, equal_nan=True)
    copy.deepcopy(ep).run_decompositions()
    if ep.example_inputs is not None:
        assert_meta_matches_runtime(ep, *ep.example_inputs)


class _DtypeChecker(torch.fx.Interpreter):
    def run_node(self, node):
        result = super().run_node(node)
        val = node.meta.get("val")
        for got, meta in zip(pytree.tree_leaves(result), pytree.tree_leaves(val)):
            if isinstance(got, torch.Tensor) and isinstance(meta, torch.Tensor):
                assert got.dtype == meta.dtype, (
                    f"{node.name}: meta says {meta.dtype}, running gives {got.dtype}"
                )
        return result


def assert_meta_matches_runtime(ep: ExportedProgram, args, kwargs=None) -> None:
    """Every node's recorded dtype is the dtype it computes when the graph runs."""
    inputs = Program.of(ep).graph_inputs(args, kwargs)
    with torch.no_grad():
        _DtypeChecker(ep.graph_module).run(*inputs)


def check_cast_program(original: ExportedProgram, cast: ExportedProgram, args: tuple) -> None:
    """``cast`` (a rewrite of ``original``) gives the outputs ``check_outputs`` asks for
    on ``args``, and is a valid program (``check_valid_program``; any error there is an
    ``AssertionError`` naming it). The outputs are checked first: a broken pass fails
    there in a fraction of the time validity takes. A failure shows the values,
    expected and got."""
    with quiet():
        check_outputs(original, cast, args)
        try:
            check_valid_program(cast)
        except AssertionError:
            raise
        except Exception as error:
            raise AssertionError(
                f"the result is not a valid program: {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}"
            ) from error


def check_outputs(original: ExportedProgram, cast: ExportedProgram, args: tuple) -> int:
    """``cast`` (a rewrite of ``original``) gives bit-exact integer outputs on ``args``,
    no inf or nan where ``original``'s outputs are finite (values fp32 holds as
    infinity-like sentinels may saturate), and float outputs within the float oracle's
    bound (``fx16.testing.oracle``: fp32 tolerance for a pass that narrows nothing, a
    small multiple of an emulation of its 16-bit rounding for a cast). Returns how many
    float outputs a finite bound checked."""
    with quiet():
        expected = Program.of(original).run(args)
        try:
            got = Program.of(cast).run(args)
        except Exception as error:  # the rewrite returned, and what it left does not run
            raise AssertionError(
                f"the rewritten program fails when run: {one_line(error)}"
            ) from error
        assert len(expected) == len(got), f"{len(got)} outputs, the original gives {len(expected)}"
        for index, (want, have) in enumerate(zip(expected, got)):
            if isinstance(want, torch.Tensor):
                _check_output(index, want, have)
        return check_floats(original, cast, args, expected, got)


def _check_output(index: int, want: torch.Tensor, have: torch.Tensor) -> None:
    if not want.is_floating_point():
        assert have.dtype == want.dtype, (
            f"integer output {index} changed dtype: expected {want.dtype}, got {have.dtype}"
        )
        differs = have != want
        assert not bool(differs.any()), (
            f"integer output {index} changed at {int(differs.sum())} of {want.numel()} "
            f"elements: {_first(differs, want, have)}"
        )
        return
    ordinary = torch.isfinite(want) & (want.abs() < INF_LIKE)
    broken = ordinary & ~torch.isfinite(have)
    assert not bool(broken.any()), (
        f"output {index}: the cast introduced inf/nan at {int(broken.sum())} of "
        f"{want.numel()} elements: {_first(broken, want, have)}"
    )


def _first(mask: torch.Tensor, want: torch.Tensor, have: torch.Tensor, shown: int = 3) -> str:
    """The first ``shown`` positions where ``mask`` holds, as "at (i, j) expected a, got b"."""
    positions = mask.nonzero()[:shown].tolist()
    return "; ".join(
        f"at {tuple(p)} expected {want[tuple(p)].item():.6g}, got {have[tuple(p)].item():.6g}"
        for p in positions
    )


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No warnings and no torch log records below ERROR while a check runs: a failing
    example's report shows the failure, not torch's trace of the export."""
    # torch's own loggers with a level of their own (torch.__trace logs at DEBUG) ignore
    # their parent's: each is raised to ERROR too, and restored after
    loggers = [logging.getLogger("torch")] + [
        logger
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.startswith("torch.")
        and isinstance(logger, logging.Logger)
        and logger.level != logging.NOTSET
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def check_pass(
    case, graph_pass: Callable[[GraphModule], object], exported: ExportedProgram | None = None
) -> ExportedProgram:
    """Run ``graph_pass`` (a ``PassBase``, or any callable taking the graph module) on
    a fresh export of ``case`` (a ``ProgramCase`` from ``fx16.testing.programs()``;
    ``exported``: that export, when made already), recompile, and check the result
    with ``check_cast_program``. Returns the program."""

    def run_on_graph(ep: ExportedProgram) -> None:
        graph_pass(ep.graph_module)
        ep.graph_module.recompile()

    return check_cast(case, run_on_graph, exported)


def check_cast(
    case, cast: Callable[[ExportedProgram], object], exported: ExportedProgram | None = None
) -> ExportedProgram:
    """Apply ``cast`` (a function rewriting an ``ExportedProgram`` in place, such as
    ``fx16.cast_fp32_to_fp16``) to a copy of an export of ``case`` (``exported``, when
    made already) and check the result with ``check_cast_program``. Returns the program."""
    with quiet():
        original = case.export() if exported is None else exported
        ep = copy.deepcopy(original)
    cast(ep)
    check_cast_program(original, ep, case.args)
    return ep
