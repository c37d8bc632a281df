"""A product of two activations past fp16's range (attention logits with a sink) takes
its scale from the projection upstream of one operand (``fx16.analysis.scale_upstream``):
folded into that projection's weight and bias, undone in the ``1/sqrt(d)`` after it."""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from benchmarks.range import SinkAttention
from fx16 import meta
from fx16.analysis.scale_domains import scale_domains
from fx16.pipelines import run_passes
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


@settings(max_examples=examples(8), deadline=None)
@given(
    st.sampled_from([{}, {"rope": True}, {"by_multiply": True}]),
    st.sampled_from([10.0, 40.0, 80.0]),
)
def test_property_the_folded_program_is_the_same_function_and_16_bit(options, loudness):
    """Attention with a sink of any loudness, with or without RoPE, the logits scaled by
    a division or a multiply: the planned fp32 program gives the original's outputs up to
    fp32 rounding (powers of two are exact), and the cast keeps every product 16-bit
    where ``scale_range=False`` keeps no more of them."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    x[:, 0] *= loudness
    model = SinkAttention(**options).eval()
    ep = export(model, x)
    passes = fx16.fp16_passes(ep)
    stages = [type(p).__name__ for p in passes]
    run_passes(passes[: stages.index("ScaleDomainsPass") + 1], ep.graph_module)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)
    cast = fx16.cast_fp32_to_fp16(export(model, x))
    plain = fx16.cast_fp32_to_fp16(export(model, x), policy=PrecisionPolicy(scale_range=False))
    assert program_stats(cast).flop_share_16bit >= program_stats(plain).flop_share_16bit
    assert program_stats(cast).flop_share_16bit == 1.0
