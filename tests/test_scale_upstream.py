"""A product of two activations past fp16's range (attention logits with a sink) takes
its scale from the projection upstream of one operand (``fx16.analysis.scale_upstream``):
folded into that projection's weight and bias, undone in the ``1/sqrt(d)`` after it."""

import pytest
import torch

import fx16
from benchmarks.range import SinkAttention
from fx16 import meta
from fx16.analysis.scale_domains import scale_domains
from fx16.policy import PrecisionPolicy
from fx16.program.stats import program_stats
from helpers import check_program, export, fp64_reference, max_error, run


def _sink_input():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    x[:, 0] *= 40
    return x


@pytest.mark.parametrize(
    "options",
    [{}, {"rope": True}, {"by_multiply": True}],
    ids=["bert_like", "rope", "multiplied"],
)
def test_attention_logits_past_the_range_fold_into_the_query_projection(options):
    """Input graph: q = linear(x) -> view -> transpose [-> rope] -> matmul(q, kᵀ) (~1e5)
    -> div by sqrt(d) -> softmax. Output: q's weight and bias stored at 2**-k, the
    logits' product 16-bit with no runtime multiply, the division's number scaled
    to undo it: every matmul FLOP 16-bit, no fp32 op that ``scale_range=False`` lacks,
    and the error no worse than that cast's (which keeps the product fp32)."""
    x = _sink_input()
    model = SinkAttention(**options).eval()
    with torch.no_grad():
        assert model.q(x).abs().max() < 3e3  # the projections are in range; their product is not
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    (domain,) = scale_domains(ep.graph_module)
    assert set(domain.folded) == {"p_q_weight", "p_q_bias"}
    assert not any(meta.RANGE_SCALE in node.meta for node in ep.graph_module.graph.nodes)
    stats = program_stats(ep)
    assert stats.flop_share_16bit == 1.0
    plain = fx16.cast_fp32_to_fp16(export(model, x), policy=PrecisionPolicy(scale_range=False))
    assert program_stats(plain).flop_share_16bit < 1.0  # what the product cost before
    assert stats.ops_in(torch.float32) <= program_stats(plain).ops_in(torch.float32)
    reference = fp64_reference(model, x)
    assert max_error(reference, run(ep, x)) <= 1.25 * max_error(reference, run(plain, x)) + 1e-3


class SharedQuery(SinkAttention):
    """The query projection is read twice: by the logits and by an output of its own."""

    def forward(self, x):
        return super().forward(x), self.q(x)


def test_a_projection_read_elsewhere_takes_no_fold():
    """A scale folded into q's weights would reach the other reader of q: no fold
    there; the key side takes it instead (its projection is read by the logits only)."""
    x = _sink_input()
    model = SharedQuery().eval()
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    (domain,) = scale_domains(ep.graph_module)
    assert set(domain.folded) == {"p_k_weight", "p_k_bias"}
    reference = fp64_reference(model, x)
    assert max_error(reference[1:], run(ep, x)[1:]) < 4 * 2.0**-11
