"""fx16.contracts: analyses record that they ran; a pass that reads one refuses to run
without it, naming it."""

import pytest
import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16 import PreconditionError
from fx16.analysis import UnsafeIndexAnalysis, ValueRangeAnalysis
from fx16.analysis.facts import Facts
from fx16.contracts import ALL, RAN_KEY, Analysis
from fx16.decisions import Reason, decision_of
from fx16.pipelines import fp16_stages, run_passes
from fx16.policy.options import Fp16Options
from helpers import check_program, export
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


class ReluMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class SwapRelu(PassBase):
    """A foreign pass, as a user's fusion pass would be: each relu replaced by a new node
    for the same op, one for one (the node count, which the facts' fingerprint reads,
    is unchanged). It declares nothing, so it preserves nothing."""

    def call(self, graph_module):
        graph = graph_module.graph
        for old in list(graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default)):
            with graph.inserting_after(old):
                new = graph.call_function(torch.ops.aten.relu.default, old.args)
            new.meta["val"] = old.meta["val"]
            old.replace_all_uses_with(new)
            graph.erase_node(old)
        return PassResult(graph_module, True)


def _relu_program():
    torch.manual_seed(0)
    return export(ReluMLP(), torch.randn(4, 8))


def test_a_foreign_rewrite_between_stages_makes_the_next_reader_refuse():
    ep = _relu_program()
    stages = fp16_stages(ep, Fp16Options())
    facts = Facts.of(ep.graph_module)
    passes = [*stages.before_decisions, *stages.decide, SwapRelu(), *stages.convert]
    run_passes(passes, ep.graph_module)
    assert Facts.of(ep.graph_module) is not facts  # dropped, though the node count held
    with pytest.raises(PreconditionError, match="reads what ExplicitFp32Analysis, Fp32Rules"):
        run_passes(stages.insert, ep.graph_module)


def test_the_analyses_run_again_after_a_foreign_rewrite_decide_its_new_nodes():
    ep = _relu_program()
    stages = fp16_stages(ep, Fp16Options())
    again = fp16_stages(ep, Fp16Options())
    fresh = [*again.calibrate, *again.analyze, *again.from_decisions]
    passes = [*stages.before_decisions, SwapRelu(), *fresh]
    run_passes(passes, ep.graph_module)
    (relu,) = ep.graph.find_nodes(op="call_function", target=torch.ops.aten.relu.default)
    assert decision_of(relu).reason is Reason.FITS
    assert relu.meta["val"].dtype == torch.float16
    check_program(ep)


def test_a_pass_that_declares_what_it_preserves_keeps_it():
    class SwapReluKeepingAll(SwapRelu):
        preserves = ALL

    ep = _relu_program()
    stages = fp16_stages(ep, Fp16Options())
    passes = [*stages.before_decisions, *stages.decide, SwapReluKeepingAll(), *stages.convert]
    run_passes(passes, ep.graph_module)
    assert {"Fp32RulesAnalysis", "ExplicitFp32Analysis"} <= ep.graph_module.meta[RAN_KEY]
    run_passes(stages.insert, ep.graph_module)  # trusted: no refusal
