"""fx16.contracts: analyses record that they ran; a pass that reads one refuses to run
without it, naming it."""

import pytest
import torch
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import PreconditionError
from fx16.analysis import UnsafeIndexAnalysis, ValueRangeAnalysis
from fx16.contracts import RAN_KEY, Analysis
from helpers import export
from models import BucketHash


class ReadsIndexMarks(Analysis):
    """A reader of UnsafeIndexAnalysis's marks."""

    needs = (UnsafeIndexAnalysis, ValueRangeAnalysis)

    def call(self, graph_module):
        return PassResult(graph_module, False)


def test_a_reader_names_what_has_not_run_and_runs_once_it_has():
    ep = export(BucketHash(), torch.arange(5))
    with pytest.raises(PreconditionError, match="reads what UnsafeIndexAnalysis, ValueRange"):
        ReadsIndexMarks()(ep.graph_module)
    UnsafeIndexAnalysis()(ep.graph_module)
    with pytest.raises(PreconditionError, match="reads what ValueRangeAnalysis finds, and it has"):
        ReadsIndexMarks()(ep.graph_module)
    ValueRangeAnalysis(ep)(ep.graph_module)
    ReadsIndexMarks()(ep.graph_module)
    assert {"UnsafeIndexAnalysis", "ValueRangeAnalysis", "ReadsIndexMarks"} <= ep.graph_module.meta[
        RAN_KEY
    ]
