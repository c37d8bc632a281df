"""Fuzz testing for passes over ``torch.export`` programs, as fx16 tests its own.

``programs()`` is a hypothesis strategy of small random, valid exported programs
(a register machine over ~75 operations: arithmetic, matmul, conv, norms, softmax,
exp/log/pow, masks, gather and index_put, creation ops, explicit casts, custom ops,
integer arithmetic, ``cond``, ``while_loop``, ``map`` and autocast regions; weights
beyond fp16's range or below its subnormals; static or dynamic batch; default export
or decomposed). ``check_pass`` runs a pass on one and checks what fx16 checks of
itself: the result lints, validates, saves and loads, decomposes and runs with the
dtypes its meta records, integer outputs stay bit-exact, and no inf or nan appears
where the original's outputs are finite::

    from hypothesis import given
    from fx16.testing import check_pass, programs

    @given(programs())
    def test_my_pass(case):
        check_pass(case, MyPass())

``fuzz_pass(MyPass)`` does the same in one call and, when the pass breaks a program,
reduces it to the steps the failure needs (a few dozen checks, not hypothesis'
minutes of shrinking) and raises ``PassBroke`` with them and the values that differ.

Needs hypothesis: ``pip install "fx16[testing]"``.
"""

try:
    import hypothesis  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError('fx16.testing needs hypothesis: pip install "fx16[testing]"') from error

from fx16.testing.checks import (
    assert_meta_matches_runtime,
    check_cast,
    check_cast_program,
    check_pass,
    check_valid_program,
)
from fx16.testing.fuzz import PassBroke, fuzz_pass
from fx16.testing.strategies import ProgramCase, programs, well_conditioned_programs

__all__ = [
    "PassBroke",
    "ProgramCase",
    "assert_meta_matches_runtime",
    "check_cast",
    "check_cast_program",
    "check_pass",
    "check_valid_program",
    "fuzz_pass",
    "programs",
    "well_conditioned_programs",
]
