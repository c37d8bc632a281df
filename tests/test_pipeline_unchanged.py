"""The pipeline decides and writes what it did before the inserter was split into choice
and rewrite, and then into a whole-graph plan and its application: the same graph code
and the same dtype and reason for every node, on the zoo's small models (one with an
accuracy budget) and on random programs drawn from the fuzzer's full menu (see
``pipeline_fingerprints``), each against the record of the same exported program (a
transformers release may export a zoo model otherwise; one without a record is
skipped, saying so). The random programs depend on torch alone: one whose export has no
record fails."""

import json
import warnings

import pytest
from pipeline_fingerprints import (
    GOLDEN,
    RANDOM_SEEDS,
    fingerprint,
    input_digest,
    random_case,
    zoo_cases,
)

import fx16

BEFORE = json.loads(GOLDEN.read_text())


def _same(name: str, ep, options: dict) -> None:
    """Cast ``ep`` with ``options`` and compare with what was recorded for ``name``."""
    before = BEFORE[name].get(input_digest(ep))
    if before is None:  # node names, and so decisions, differ too
        # a random program depends on torch and the recorded menu alone: never skipped
        assert not name.startswith("random"), f"{name}: the program drawn is not the recorded one"
        pytest.skip(f"{name}: no recorded cast of the program this transformers exports")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        now = fingerprint(fx16.cast_fp32_to_fp16(ep, **options))
    changed = {
        node: (before["decisions"].get(node), decision)
        for node, decision in now["decisions"].items()
        if before["decisions"].get(node) != decision
    }
    missing = sorted(set(before["decisions"]) - set(now["decisions"]))
    assert not changed and not missing, f"{name}: changed {changed}, no longer decided {missing}"
    assert now["code"] == before["code"], f"{name}: the same decisions, but other graph code"


@pytest.mark.parametrize("name", sorted(zoo_cases()))
def test_the_zoo_is_cast_as_before(name):
    make, options = zoo_cases()[name]
    _same(name, make(), options)


def test_random_programs_are_cast_as_before():
    for seed in RANDOM_SEEDS:
        _same(f"random {seed}", random_case(seed).export(), {})
