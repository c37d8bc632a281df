"""Every benchmark-zoo model, in the training IR and decomposed, under the main policies:
the cast program stays valid (lint, validate, save/load, decompositions, meta dtypes).
The bounded run (CI) casts the decomposed program, by default and under one other policy
by turns; ``FX16_FUZZ=long`` casts both IRs under every policy."""

import copy
import os

import pytest
import torch

import fx16
from benchmarks.compare import models
from helpers import check_program

FULL = os.environ.get("FX16_FUZZ") == "long"
CASES = [(name, build, draw) for name, build, draw in models()]
POLICIES = ["default", "auto_mixed_bf16", "autocast"]
IRS = ["training", "aten"] if FULL else ["aten"]


def _policies(index: int) -> list[str]:
    """Every policy in the long run; in the bounded one, the default and one of the others
    by turns, so that each is cast on half of the models."""
    return POLICIES if FULL else ["default", POLICIES[1 + index % 2]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "index, name, build, draw",
    [(index, *case) for index, case in enumerate(CASES)],
    ids=[name for name, _, _ in CASES],
)
def test_zoo_model_casts_to_a_valid_program(index, name, build, draw):
    torch.manual_seed(0)
    model, args = build(), draw()
    exported = torch.export.export(model, args)
    for ir in IRS:
        program = exported.run_decompositions() if ir == "aten" else exported
        for policy in _policies(index):
            cast = fx16.cast_to_16_bit_precision(copy.deepcopy(program), policy=policy)
            check_program(cast)
