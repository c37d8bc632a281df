"""A product of two activations past fp16's range (attention logits with a sink) takes
its scale from the projection upstream of one operand (``fx16.analysis.scale_upstream``):
folded into that projection's weight and bias, undone in the ``1/sqrt(d)`` after it."""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from benchmarks.range import SinkAttention
from fx16 import meta
from fx16.analysis.scale_domains import scale_domains
from fx16.passes.scale_domains import REVERTED
from fx16.pipelines import run_passes
from fx16.policy import PrecisionPolicy
from fx16.program.stats import program_stats
from helpers import check_program, export, fp64_reference, max_error, run, scale_only


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
    assert {"linear", "matmul"} <= set(domain.values)  # the way from the fold to the logits
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


class Query(nn.Module):
    """Attention logits past fp16's range (~2e5, a sink token) whose key projection is
    also returned (read elsewhere: only the query side may take the fold), with the
    query made as ``form`` says: a projection under ``depth`` negations ("deep") or
    factors of 2 and 1/2 ("deep_factors"), a sum of two projections, a projection
    through a tanh or a square root, the input squared, a projection of a projection
    whose weight is read elsewhere ("stacked"), a projection whose bias is read
    elsewhere, a projection with a bias of ~1e-4 ("small_bias"), or one with weights of
    ~0.04 and the key's 32x ("small_weight")."""

    def __init__(self, form: str, depth: int = 0) -> None:
        super().__init__()
        self.form, self.depth = form, depth
        self.q, self.q2, self.k, self.v = (nn.Linear(64, 64) for _ in range(4))
        with torch.no_grad():
            self.q.weight.mul_(8)
            self.k.weight.mul_(8)
            if form == "small_bias":
                self.q.bias.mul_(1e-3)
            if form == "small_weight":
                self.q.weight.mul_(0.3 / 8)
                self.k.weight.mul_(32)

    def forward(self, x):
        k, q = self.k(x), self.q(x)
        extra = k
        if self.form == "deep":
            for _ in range(self.depth):
                q = -q
        elif self.form == "deep_factors":
            for step in range(self.depth):
                q = q * (2.0 if step % 2 else 0.5)
        elif self.form == "power":
            q = q.abs().sqrt() * 8
        elif self.form == "sum":
            q = q + self.q2(x)
        elif self.form == "tanh":
            q = torch.tanh(q / 1000) * 1000
        elif self.form == "square":
            q = x * x
        elif self.form == "stacked":
            q = self.q2(q)
            extra = k + self.q2.weight.sum()
        elif self.form == "shared_bias":
            extra = k + self.q.bias.sum()
        scores = q @ k.transpose(-1, -2) / 8
        return scores.softmax(-1) @ self.v(x), extra


@pytest.mark.parametrize(
    ("form", "depth", "folded"),
    [
        ("deep", 32, {"p_q_weight", "p_q_bias"}),
        ("deep", 33, set()),
        ("deep_factors", 32, {"p_q_weight", "p_q_bias"}),
        ("deep_factors", 33, set()),
        ("power", 0, set()),
        ("small_weight", 0, set()),
        ("sum", 0, {"p_q_weight", "p_q_bias", "p_q2_weight", "p_q2_bias"}),
        ("small_bias", 0, {"p_q_weight", "p_q_bias"}),
        ("tanh", 0, set()),
        ("square", 0, set()),
        ("stacked", 0, set()),
        ("shared_bias", 0, set()),
    ],
)
def test_the_walk_up_from_the_logits_folds_only_what_carries_the_query_exactly(form, depth, folded):
    """The query's scale is folded upstream only where every op between the projection
    and the logits is linear in it and read on that path alone: through 32 ops (the
    walk's depth), not 33; into both projections of a sum; into a bias of ~1e-4, which
    the product it is added to absorbs however far it shrinks. Not through a tanh or a
    square root, not into an input (the square of x has no weight), not past a
    projection whose weight or bias something else reads (the scale would reach it),
    not into weights the fold would take below 2**-8 (their small elements would leave
    the normal range). The planned program computes what the model does, bit for bit."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    x[:, 0] *= 40
    model = Query(form, depth).eval()
    ep = export(model, x)
    scale_only(ep)
    assert REVERTED not in ep.graph_module.meta, ep.graph_module.meta.get(REVERTED)
    (domain,) = scale_domains(ep.graph_module)
    assert set(domain.folded) == folded
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(x), ep.module()(x), strict=True))
