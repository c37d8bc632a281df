"""Transactions: a block of rewrites of a program that is undone whole if it fails, its
state conversions committed at its end (``Program.transaction``)."""

import contextlib
from collections.abc import Iterator

from fx16.errors import Fx16Error, PassFailedError
from fx16.program.snapshot import collector_paused

# graph_module.meta key: whether a transaction defers converting state to its commit
# (the state decided on but not converted yet is under fx16.program.snapshot.PENDING).
DEFERRING = "fx16.defers_state"


@contextlib.contextmanager
def transaction(program, progress: bool | None = False) -> Iterator[None]:
    """Run a block that rewrites ``program`` (a ``fx16.program.Program``); if it raises,
    put everything back.

    Two phases. The block decides: passes rewrite the graph and ``store_state``
    records the dtype each state tensor is stored in, converting nothing (a bf16
    checkpoint's tensors, widened to fp32 for the fp32 rules, stay bf16). Then the
    commit converts them (``commit_state``, with ``progress``), after the snapshot has
    let go of the originals, so that each is freed as soon as it is replaced. No copy is
    held for the sake of restoring: a failure in the block finds the state untouched;
    the commit can only fail for want of memory, and it converts the largest tensor
    first, so when fx16 holds the only references every later conversion finds at least
    as much memory free as the first did, and when the caller holds them they are still
    alive to be put back.

    On failure, restores what ``snapshot`` saves, then raises the error as an
    ``Fx16Error`` (a ``PassFailedError`` naming the stage when it was not one already).
    The cyclic garbage collector waits until the block ends: the passes create many
    small objects, and each collection they trigger walks every node of the graph again
    (on a 20,000-node graph, pausing it cut the cast's time by a fifth).
    """
    meta = program.graph_module.meta
    if meta.get(DEFERRING):  # nested: the outer transaction commits
        yield
        return
    saved, error = program.snapshot(), None
    meta[DEFERRING] = True
    try:
        with collector_paused():
            yield
            saved.release_state()
            program.commit_state(progress)
    except BaseException as raised:
        error = raised
        saved.restore()
    finally:
        meta.pop(DEFERRING, None)
    if error is None:
        return
    if isinstance(error, PassFailedError) and not error.restored:  # now it is
        raise PassFailedError(error.stage, error.__cause__) from error.__cause__
    if isinstance(error, Fx16Error) or not isinstance(error, Exception):
        raise error
    raise PassFailedError("commit" if saved.released else "unknown", error) from error
