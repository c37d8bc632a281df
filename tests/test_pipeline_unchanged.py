"""The pipeline decides and writes what it did before the inserter was split into choice
and rewrite, and then into a whole-graph plan and its application: the same graph code
and the same dtype and reason for every node, on the zoo's small models (one with an
accuracy budget) and on random programs drawn from the fuzzer's full menu (see
``pipeline_fingerprints``)."""

import json
import warnings

import pytest
from pipeline_fingerprints import GOLDEN, RANDOM_SEEDS, fingerprint, random_case, zoo_cases

import fx16

BEFORE = json.loads(GOLDEN.read_text())


def _same(name: str, ep) -> None:
    now, before = fingerprint(ep), BEFORE[name]
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same(name, fx16.cast_fp32_to_fp16(make(), **options))


def test_random_programs_are_cast_as_before():
    for seed in RANDOM_SEEDS:
        case = random_case(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _same(f"random {seed}", fx16.cast_fp32_to_fp16(case.export()))
