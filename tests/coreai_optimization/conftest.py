"""coreai-optimization's own casting tests, run with fx16 in coreai-opt's place.

``test_coreai_opt_casting.py`` is apple/coreai-optimization's ``tests/casting/test_casting.py``
(commit 859d7c9, BSD-3-Clause: see LICENSE beside it), changed in one line: it imports its
two models from ``coreai_opt_models.py`` (copied from its ``tests/models/simple.py``). Each
test calls ``cast_fp32_to_fp16``, ``cast_int32_to_int16`` and ``cast_to_16_bit_precision`` by
the names it imports from ``coreai_opt.casting``; here those names are fx16's, as a user's
code is after switching the import. It quantizes with coreai-opt, so it needs the
``coreai`` extra.
"""

import importlib.util

import pytest

import fx16

REBOUND = ("cast_fp32_to_fp16", "cast_int32_to_int16", "cast_to_16_bit_precision")

collect_ignore = [] if importlib.util.find_spec("coreai_opt") else ["test_coreai_opt_casting.py"]


@pytest.fixture(autouse=True)
def fx16_in_coreai_opts_place(request, monkeypatch):
    """Rebind the module's three functions to fx16's and check, after the test, that it
    cast through fx16 (so a pass is fx16's, not coreai-opt's)."""
    calls = []

    def counted(function):
        def call(*args, **kwargs):
            calls.append(function.__name__)
            return function(*args, **kwargs)

        return call

    for name in REBOUND:
        monkeypatch.setattr(request.module, name, counted(getattr(fx16, name)))
    yield
    assert calls, f"{request.node.name} cast nothing through fx16"
