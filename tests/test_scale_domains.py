"""ScaleDomainsAnalysis and ScaleDomainsPass: values past fp16's range carried at a
power-of-two scale instead of in fp32, on small exported programs and on the range
benchmark's models; errors bounded against fp64."""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fx16
from benchmarks import zoo
from benchmarks.range import GrowingCnn, GrowingConvs, LoudAttention, RawReadings, RawUnits
from benchmarks.range_flows import PreNormResidual as Residual
from benchmarks.range_flows import ResidualInACond
from fx16 import meta
from fx16.analysis.scale_domains import scale_domains
from fx16.policy import PrecisionPolicy
from fx16.program.stats import program_stats
from fx16.report import report_of
from fx16.testing import programs
from helpers import check_program, export, fp64_reference, max_error, run, scale_only

NO_SCALING = PrecisionPolicy(scale_range=False)


def _fp32_ops(ep) -> int:
    return program_stats(ep).ops_in(torch.float32)


def test_a_residual_stream_past_the_range_stays_16_bit_with_its_scale_folded():
    torch.manual_seed(0)
    model, x = Residual().eval(), torch.randn(4, 16)
    with torch.no_grad():
        assert model.embed(x).abs().max() < 100 and (model(x) - model(x)).abs().max() == 0
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    domains = scale_domains(ep.graph_module)
    assert domains and all(domain.k >= 1 and domain.folded for domain in domains)
    stats = program_stats(ep)
    assert stats.flop_share_16bit == 1.0
    # no runtime multiply: the scale starts in the weights and ends in the norm's eps
    assert not any(meta.RANGE_SCALE in node.meta for node in ep.graph_module.graph.nodes)
    error = max_error(fp64_reference(model, x), run(ep, x))
    assert error < 8 * 2.0**-11 * 16  # a few roundings per block, well inside fp16's bound
    fp32 = fx16.cast_fp32_to_fp16(export(model, x), policy=NO_SCALING)
    assert _fp32_ops(ep) < _fp32_ops(fp32)  # what it cost before


def test_the_scaled_program_computes_the_same_function_in_fp32():
    """Powers of two are exact: the scaled fp32 program (before any 16-bit decision)
    gives the original's outputs bit for bit on these inputs."""
    torch.manual_seed(0)
    model, x = Residual().eval(), torch.randn(4, 16)
    ep = export(model, x)
    scale_only(ep)
    assert scale_domains(ep.graph_module)
    with torch.no_grad():
        assert torch.equal(ep.module()(x), model(x))


class LayerNormResidual(Residual):
    @staticmethod
    def norm(x):
        return nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-5)


def test_a_norms_eps_is_scaled_with_its_input():
    """LayerNorm(s x) with eps s**2 eps is LayerNorm(x): the scale ends there."""
    torch.manual_seed(0)
    model, x = LayerNormResidual().eval(), torch.randn(4, 16)
    ep = export(model, x)
    scale_only(ep)
    (domain,) = scale_domains(ep.graph_module)
    eps = {
        node.args[4]
        for node in ep.graph_module.graph.nodes
        if node.target is torch.ops.aten.layer_norm.default
    }
    assert 1e-5 * 2.0 ** (-2 * domain.k) in eps
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-6, atol=1e-6)


def test_a_cnn_whose_activations_grow_block_by_block_folds_into_batch_norm():
    torch.manual_seed(0)
    model, x = GrowingCnn().eval(), torch.randn(2, 8, 8, 8)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    assert program_stats(ep).flop_share_16bit == 1.0
    reference = fp64_reference(model, x)
    assert max_error(reference, run(ep, x)) < 2e-3
    assert _fp32_ops(ep) < _fp32_ops(fx16.cast_fp32_to_fp16(export(model, x), policy=NO_SCALING))


def test_a_batch_norm_on_running_statistics_takes_the_scale_in_its_weight():
    """Eval BatchNorm is a per-channel affine: its input's scale passes to its output
    through the weight (folded), the mean is scaled alike, and the variance and eps stay
    as they are (at 2**(2 * scale) a variance of 0.05 and eps 1e-5 flush in fp16).
    No runtime multiply reads a running statistic, and every BatchNorm is 16-bit."""
    torch.manual_seed(0)
    model, x = GrowingCnn().eval(), torch.randn(2, 8, 8, 8)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    norms = [
        n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.batch_norm.default
    ]
    assert len(norms) == 6
    for norm in norms:
        assert norm.args[4].op == "placeholder" and norm.args[7] == 1e-5
        assert norm.meta["val"].dtype == torch.float16
    assert max(domain.k for domain in scale_domains(ep.graph_module)) >= 7
    # the calibration input, a fresh draw, and one whose first sample is near-silent
    quiet = torch.randn(2, 8, 8, 8)
    quiet[0] *= 1e-3
    for inputs in (x, torch.randn(2, 8, 8, 8), quiet):
        (reference,), (out,) = fp64_reference(model, inputs), run(ep, inputs)
        for sample in range(2):  # each sample against its own magnitude
            assert max_error([reference[sample]], [out[sample]]) < 2e-3


def test_a_scaled_value_enters_a_conds_body_unscaled():
    """A growing CNN whose last block sits in both branches of a cond: the domain's scale
    is undone before the cond (a body reads its operands unscaled), so the branch computes the
    function as written; the result is finite and within 16-bit rounding of fp64."""

    class LastBlockInACond(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = GrowingCnn(blocks=5).features
            self.last = GrowingCnn(blocks=1).features
            self.head = GrowingCnn().head

        def forward(self, x):
            h = self.features(x)
            h = torch.cond(h.sum() > 0, lambda t: self.last(t), lambda t: self.last(t) * 0.5, (h,))
            return self.head(h.mean((2, 3)))

    torch.manual_seed(0)
    model, x = LastBlockInACond().eval(), torch.randn(2, 8, 8, 8)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    assert any(node.target is torch.ops.higher_order.cond for node in ep.graph.nodes)
    assert scale_domains(ep.graph_module)
    for inputs in (x, torch.randn(2, 8, 8, 8)):
        assert max_error(fp64_reference(model, inputs), run(ep, inputs)) < 2e-3


@pytest.mark.parametrize("shared", [False, True])
def test_a_residual_stream_inside_a_conds_branch_is_scaled_in_the_branch(shared):
    """Input graph: cond(flag, stream, other, (x,)), the stream's residual growing to
    8e4 inside the true branch. Output: a domain planned in the branch's own graph, its
    weights folded (the program passes them to that branch alone); every FLOP 16-bit
    and no fp32 op (the branch's linears were fp32: 40% of FLOPs 16-bit). A weight both
    branches read is not folded (the other branch reads it as it is): the domain starts
    at a multiply inside the branch instead. Both branches within 16-bit rounding of
    fp64."""
    torch.manual_seed(0)
    model, x, flag = ResidualInACond(shared).eval(), torch.randn(4, 16), torch.ones(1)
    ep = fx16.cast_fp32_to_fp16(export(model, x, flag))
    check_program(ep)
    (domain,) = scale_domains(ep.graph_module)
    stats = program_stats(ep)
    assert stats.flop_share_16bit == 1.0 and _fp32_ops(ep) == 0
    embed = ep.state_dict["stream.embed.weight"].float()
    assert torch.equal(embed, model.stream.embed.weight.half().float()) == shared
    assert ("p_stream_embed_weight" in domain.folded) != shared
    for branch in (flag, -flag):
        error = max_error(fp64_reference(model, x, branch), run(ep, x, branch))
        assert error < 8 * 2.0**-11 * 16


def test_inputs_in_raw_units_are_scaled_at_the_door_and_the_first_layer_takes_it_back():
    torch.manual_seed(0)
    model, x = RawUnits().eval(), torch.rand(8, 16) * 1e6
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    assert program_stats(ep).flop_share_16bit == 1.0
    assert max_error(fp64_reference(model, x), run(ep, x)) < 2e-3
    lines = report_of(ep).summary()
    assert any(
        line.startswith("range: scale domain") and "x scaled at the door" in line for line in lines
    )
    doors = [n.meta[meta.RANGE_SCALE] for n in ep.graph.nodes if meta.RANGE_SCALE in n.meta]
    assert doors == ["x 2**-5: starts a scale domain"]  # the multiply says why it is there


def test_a_llama_with_massive_activations_keeps_every_product_16_bit():
    torch.manual_seed(0)
    model, ids = zoo.massive_llama(2, 2e5).eval(), zoo.massive_ids()
    ep = fx16.cast_fp32_to_fp16(torch.export.export(model, (ids,)))
    assert program_stats(ep).flop_share_16bit == 1.0
    twin = fx16.cast_fp32_to_fp16(torch.export.export(zoo.massive_llama(2, 2e3).eval(), (ids,)))
    assert _fp32_ops(ep) <= _fp32_ops(twin)  # no op fp32 for range alone
    assert program_stats(ep).casts <= program_stats(twin).casts


def test_a_where_that_picks_a_scaled_fill_is_judged_by_the_fill_at_the_output():
    """The output's multiply undoes the scale of a domain whose members reached 7e4:
    on an input where the where picks the fill, 16-bit would overflow there."""

    class Fill(nn.Module):
        def forward(self, x):
            return torch.where(x > 0, x, torch.full_like(x, 7e4))

    x = torch.rand(2, 4) + 0.1  # the calibration never picks the fill
    ep = fx16.cast_fp32_to_fp16(export(Fill(), x))
    other = -torch.rand(2, 4)
    out = run(ep, other)[0].float()
    assert ((out - 7e4).abs() <= 7e4 * 2.0**-11).all()  # 7e4, rounded once to 16-bit


def test_a_second_cast_changes_nothing():
    torch.manual_seed(0)
    ep = fx16.cast_fp32_to_fp16(export(Residual().eval(), torch.randn(4, 16)))
    code = ep.graph_module.code
    fx16.pipelines.run_passes(fx16.fp16_passes(ep), ep.graph_module)
    assert ep.graph_module.code == code


def test_an_integer_operand_is_not_reached_by_thescale_only():
    """``x + offsets`` with int offsets (or a symbolic size): a scale on x would not reach
    the integers, so the add reads x unscaled (long-fuzz finding: the scaled program's
    outputs moved by the offsets' share and the whole plan was taken back)."""
    from fx16.passes.scale_domains import REVERTED

    class Offsets(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("offsets", torch.arange(-6, 6, dtype=torch.int32).view(3, 4))

        def forward(self, x):
            return x.abs(), x + self.offsets, torch.maximum(x, self.offsets)

    torch.manual_seed(0)
    x = torch.randn(3, 4) * 1e5
    ep = export(Offsets(), x)
    with torch.no_grad():
        reference = ep.module()(x)
    scale_only(ep, calibration=[(x,)])
    assert REVERTED not in ep.graph_module.meta
    assert scale_domains(ep.graph_module)  # x is still carried at a scale
    with torch.no_grad():
        for expected, got in zip(reference, ep.module()(x)):
            assert torch.equal(expected, got)


def test_a_product_of_two_scaled_values_stays_in_fp32s_range():
    """x * relu(x) over values from 1 to 1e18: the domain's scale is about 2**-105, and
    the product of two operands at it, about 2**-210, would take the small elements
    below fp32's subnormals. The product reads one operand unscaled instead (long-fuzz
    finding: the plan moved the outputs and was taken back whole)."""
    from fx16.passes.scale_domains import REVERTED

    class Wide(nn.Module):
        def forward(self, x):
            product = x * x.relu()
            return x.abs(), product, torch.sigmoid(product)

    x = torch.tensor([[1.0, 3.0, 1e9, 1e18], [2.0, -5.0, 7e12, 1e17]])
    ep = export(Wide(), x)
    with torch.no_grad():
        reference = ep.module()(x)
    scale_only(ep, calibration=[(x,)])
    assert REVERTED not in ep.graph_module.meta
    assert max(domain.k for domain in scale_domains(ep.graph_module)) > 75
    with torch.no_grad():
        for expected, got in zip(reference, ep.module()(x)):
            assert torch.equal(expected, got)


def test_bf16_and_the_autocast_preset_do_notscale_only():
    torch.manual_seed(0)
    model, x = Residual().eval(), torch.randn(4, 16)
    for policy in ("auto_mixed_bf16", "autocast"):
        ep = fx16.cast_fp32_to_fp16(export(model, x), policy=policy)
        assert not scale_domains(ep.graph_module)


@settings(max_examples=examples(15), deadline=None)
@given(programs(), st.sampled_from([1.0, 1e3, 1e5]))
def test_property_the_scaled_fp32_program_is_the_same_function(case, input_scale):
    """Random programs from the fuzzer's full menu, their inputs scaled so that values
    leave fp16's range: every plan applies whole (none taken back: each op's rule in
    ``fx16.ops.scaling`` held), and the scaled fp32 program gives the original's outputs
    up to fp32's rounding. One exception, where fp32's own outputs are not finite: a
    value in fp32's subnormals scaled down to 0 and then multiplied by inf (a scalar of
    the menu's) gives nan for inf, so the plan may be taken back there (long-fuzz
    finding: exp of -93, then ``(x.double() * inf).float()``). Every folded tensor stays
    inside the limit (``_check_folds_inside_the_limit``)."""
    from fx16.passes.scale_domains import REVERTED, same_outputs

    ep = case.export()
    args = tuple(a * input_scale if a.is_floating_point() else a for a in case.args)
    with torch.no_grad():
        reference = [list(torch.utils._pytree.tree_leaves(ep.module()(*args)))]
    before = {name: tensor.clone() for name, tensor in ep.state_dict.items()}
    scale_only(ep, calibration=[args])
    finite = all(bool(torch.isfinite(v).all()) for v in reference[0] if v.is_floating_point())
    assert not finite or REVERTED not in ep.graph_module.meta, ep.graph_module.meta[REVERTED]
    with torch.no_grad():
        outputs = [list(torch.utils._pytree.tree_leaves(ep.module()(*args)))]
    assert same_outputs(reference, outputs)
    _check_folds_inside_the_limit(ep, before)


def _check_folds_inside_the_limit(ep, before: dict) -> None:
    """What every fold promises of the tensor it scales: its largest magnitude inside the
    limit (fp16's largest over the margin) unless it lay past it already. (A bias may be
    folded below fp16's normal range where the least k that fits needs it: the product
    it is added to absorbs its rounding; found by this property in a loop's body.)"""
    limit = float(torch.finfo(torch.float16).max) / 2
    for name, tensor in ep.state_dict.items():
        was = before.get(name)
        if was is None or not tensor.is_floating_point() or torch.equal(tensor, was):
            continue
        largest, largest_before = float(tensor.abs().max()), float(was.abs().max())
        assert largest <= max(limit, largest_before), name


class ResidualIntoAutocastOff(Residual):
    """The scaled stream read inside the model's own ``autocast(enabled=False)`` body."""

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(self.norm(h))
        with torch.autocast("cpu", enabled=False):
            kept = h * 0.5
        return self.norm(h), kept


def test_a_body_reads_the_scaled_value_unscaled():
    """A higher-order op's body reads its operands unscaled: the value that enters the
    user's fp32 region is the original one (the region's output is the fp32 value, not
    2**-k of it)."""
    torch.manual_seed(0)
    model, x = ResidualIntoAutocastOff().eval(), torch.randn(4, 16)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    assert scale_domains(ep.graph_module)
    reference = fp64_reference(model, x)
    outputs = run(ep, x)
    assert max_error(reference, outputs) < 1e-2
    ratio = (outputs[1].double() / reference[1].double()).median()
    assert abs(float(ratio) - 1.0) < 1e-2  # not a power of two off


def test_a_program_that_writes_a_float_in_place_is_not_scaled():
    """Long-fuzz finding: ``h.float().view(-1)[:1].mul_(0.5)`` (an export that was not
    functionalized keeps the write through the alias) at inputs of 1e5: a scale on the
    way took the write away from ``h``, and the plan was taken back. Such a graph is not
    planned, and the cast is the same function."""
    from fx16.passes.scale_domains import REVERTED
    from fx16.testing.random_programs import RandomProgram

    torch.manual_seed(0)
    steps = [("abs", 0, 0, 1e-9), ("write_through_alias", 0, 0, 1e-9)]
    model = RandomProgram(2, steps, []).eval()
    x, ids = torch.randn(3, 2) * 1e5, torch.tensor([[9, 10], [10, 15], [8, 1]])
    ep = torch.export.export(model, (x, ids))
    assert any(n.target is torch.ops.aten.mul_.Tensor for n in ep.graph_module.graph.nodes)
    with torch.no_grad():
        want = list(torch.utils._pytree.tree_leaves(ep.module()(x, ids)))
    scale_only(ep, calibration=[(x, ids)])
    assert REVERTED not in ep.graph_module.meta and not scale_domains(ep.graph_module)
    with torch.no_grad():
        got = list(torch.utils._pytree.tree_leaves(ep.module()(x, ids)))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_domain_no_op_reads_scaled_is_not_planned():
    """Attention logits at 3e5 come out of a product of in-range values and a softmax
    reads them unscaled: a multiply by 2**-k after the product, undone before every
    reader, would scale nothing; the plan leaves them to their fp32 rule alone."""
    torch.manual_seed(0)
    model, x = LoudAttention(), torch.randn(2, 16, 64)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    assert not scale_domains(ep.graph_module)
    assert not [n for n in ep.graph.nodes if meta.range_scaled(n)]
    fp32 = {row.node for row in report_of(ep).rows if row.dtype == "float32"}
    assert fp32 == {"matmul", "softmax"}  # the product past the range, and its reader
    assert max_error(fp64_reference(model, x), run(ep, x)) < 4e-3


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_a_recurrent_layer_on_raw_readings_takes_the_door_scale_in_its_input_weights(
    kind, bidirectional
):
    """Input graph: x (~1e5, fp32) -> lstm/gru/rnn_tanh (W_ih ~1e-6) -> linear. Output:
    x * 2**-k at the door (the one fp32 op), the first layer's input weights stored at
    2**k, in fp16's normal range, and the recurrent layer 16-bit: every matmul FLOP of
    the program (the layer's gates counted) 16-bit, within 16-bit rounding of fp64."""
    torch.manual_seed(0)
    model, x = RawReadings(kind, bidirectional).eval(), torch.randn(4, 12, 8) * 1e5
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    stats = program_stats(ep)
    assert stats.flop_share_16bit == 1.0 and stats.product_flops > 20_000
    assert _fp32_ops(ep) == 1  # the door's multiply
    state = dict(ep.state_dict)
    for name in state:
        if name.startswith("rnn.weight_ih_l0"):
            stored = state[name]
            assert stored.dtype == torch.float16
            assert 2.0**-8 <= float(stored.abs().max()) <= 65504 / 2
    error = max_error(fp64_reference(model, x), run(ep, x))
    assert error < 8 * 2.0**-11
    plain = fx16.cast_fp32_to_fp16(export(model, x), policy=NO_SCALING)
    assert program_stats(plain).flop_share_16bit < 0.01  # the layer fp32, and counted so


def test_no_domain_is_planned_inside_the_models_own_fp32_regions():
    """Input graph: a Llama with massive activations, whose RMSNorms compute their mean
    of squares in fp32 (``x.float().pow(2).mean()``, up to 4e10). Those regions stay
    fp32 (``explicit_fp32="keep"``): no domain starts or grows in them, and no runtime
    multiply is planned there (each norm had two, which changed nothing)."""
    from fx16.analysis.explicit_fp32 import model_fp32_regions

    torch.manual_seed(0)
    ep = export(zoo.massive_llama(3, 2e5).eval(), zoo.massive_ids())
    scale_only(ep)
    regions = {node.name for node in model_fp32_regions(ep.graph_module)}
    assert regions
    domains = scale_domains(ep.graph_module)
    assert domains and not any(set(domain.values) & regions for domain in domains)
    assert not any(meta.RANGE_SCALE in node.meta for node in ep.graph_module.graph.nodes)


def _fitted_cnn() -> GrowingCnn:
    """The growing CNN with its BatchNorms' running statistics fitted to data, as a
    trained model's are: nonzero running means (the inputs carry an offset), each
    weight then set to 30 standard deviations so that the blocks still grow past
    fp16's range."""
    torch.manual_seed(0)
    model = GrowingCnn()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for norm in norms:
        norm.momentum = None  # a cumulative average over the fitting batches
    model.train()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(4, 8, 8, 8) + 0.5)
        for norm in norms:
            norm.weight.copy_(30 * (norm.running_var + norm.eps).sqrt())
    return model.eval()


def test_a_batch_norm_with_fitted_running_statistics_scales_its_mean_with_its_input():
    """Input graph: the growing CNN with nonzero running means. Output: the plan
    applies whole (the scaled fp32 program computes the same function: a mean left
    unscaled would move the outputs and take the plan back), every BatchNorm 16-bit,
    within 16-bit rounding of fp64."""
    model = _fitted_cnn()
    means = [m.running_mean.abs().max() for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert min(means) > 1e-2  # fitted, not the zeros of a fresh model
    x = torch.randn(2, 8, 8, 8) + 0.5
    ep = export(model, x)
    scale_only(ep)
    assert scale_domains(ep.graph_module)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), model(x), rtol=1e-5, atol=1e-5)
    cast = fx16.cast_fp32_to_fp16(export(model, x))
    assert max(domain.k for domain in scale_domains(cast.graph_module)) >= 7
    assert program_stats(cast).flop_share_16bit == 1.0
    assert max_error(fp64_reference(model, x), run(cast, x)) < 2e-3


def test_no_fold_takes_a_stored_tensor_below_fp16s_normal_range():
    """Every state tensor a cast stores in fp16 keeps its largest magnitude in fp16's
    normal range, after its folds, on the range benchmark's models (a fold of 2**-13
    into a conv bias of 0.08 would leave it subnormal)."""
    tiny = torch.finfo(torch.float16).tiny
    torch.manual_seed(0)
    for model, x in (
        (_fitted_cnn(), torch.randn(2, 8, 8, 8)),
        (Residual(blocks=4, gain=3e5).eval(), torch.randn(4, 16)),
        (RawUnits().eval(), torch.rand(8, 16) * 1e6),
    ):
        ep = fx16.cast_fp32_to_fp16(export(model, x))
        assert scale_domains(ep.graph_module)
        for name, tensor in ep.state_dict.items():
            if tensor.dtype == torch.float16 and tensor.abs().max() > 0:
                assert float(tensor.abs().max()) >= tiny, name


def test_a_bias_folded_below_the_normal_range_stays_16_bit():
    """Input graph: ten convs growing to 1e7, a down- and an upsampling conv. Output:
    the biases folded by 2**-11 are stored fp16 (their rounding is absorbed by the
    product they are added to; the row says they were folded), every conv 16-bit,
    no fp32 op (each such bias kept every conv after it fp32: 49% of FLOPs)."""
    torch.manual_seed(0)
    model, x = GrowingConvs().eval(), torch.randn(2, 8, 16, 16)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    assert max(domain.k for domain in scale_domains(ep.graph_module)) >= 10
    stats = program_stats(ep)
    assert stats.flop_share_16bit == 1.0 and stats.ops_in(torch.float32) == 0
    folded = [row for row in report_of(ep).rows if "a bias folded by 2**" in row.detail]
    assert folded and all(row.dtype == "float16" for row in folded)
    assert max_error(fp64_reference(model, x), run(ep, x)) < 8 * 2.0**-11


class SubnormalBandWeights(nn.Module):
    """A product with weights of ~1e-6: below fp16's normal range (6.1e-5) but above its
    smallest subnormal (6e-8), so fp16 would hold them with a few bits; then a scale back."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(32, 32) * 1e-6)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head((x @ self.gain) * 1e5)


def test_weights_in_the_subnormal_band_are_carried_at_a_power_of_two():
    """Input graph: x @ gain (~1e-6) -> * 1e5 -> linear. Output: gain stored fp16 at
    2**k with its largest normal, the product 16-bit, within 16-bit rounding of fp64
    (stored as fp16 subnormals it would keep 4-6 bits: errors of a few percent)."""
    torch.manual_seed(0)
    model, x = SubnormalBandWeights().eval(), torch.randn(8, 32)
    assert 6e-8 < model.gain.abs().max() < 6.1e-5
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    stored = ep.state_dict["gain"]
    assert stored.dtype == torch.float16
    assert float(stored.abs().max()) >= torch.finfo(torch.float16).tiny
    assert program_stats(ep).flop_share_16bit == 1.0
    assert max_error(fp64_reference(model, x), run(ep, x)) < 8 * 2.0**-11


def test_with_calibrated_regions_a_domain_may_let_a_region_fit():
    """explicit_fp32="calibrated" keeps a region only on evidence; a domain through it
    is what removes the evidence (the mean of squares of a residual of 2e5), so there
    domains still cross the model's fp32 regions and they retarget to 16-bit: a few
    fp32 ops besides the rotary tables (kept for their conditioning, as either way),
    where "keep" keeps every region's ops."""
    torch.manual_seed(0)
    model, ids = zoo.massive_llama(3, 2e5).eval(), zoo.massive_ids()
    kept = fx16.cast_fp32_to_fp16(export(model, ids))
    calibrated = fx16.cast_fp32_to_fp16(export(model, ids), explicit_fp32="calibrated")
    rows = report_of(calibrated).rows
    wide = [r for r in rows if r.dtype == "float32" and r.rule != "ill_conditioned"]
    assert len(wide) <= 4 and _fp32_ops(calibrated) < _fp32_ops(kept)
    assert program_stats(calibrated).flop_share_16bit == 1.0
    # a domain 2**18 and 2**24 from its readers undoes its scale in steps, each a 16-bit
    # number: no scale it makes is an fp32 scalar
    steps = [meta.range_scaled(n) for n in calibrated.graph.nodes if meta.range_scaled(n)]
    steps = [int(step.split("2**")[1].split(":")[0]) for step in steps]
    assert max(steps) == 15 and all(-24 <= step <= 15 for step in steps)


@pytest.mark.parametrize(
    "build, scale", [(RawUnits, 1e6), (LayerNormResidual, 1.0), (GrowingCnn, 1.0)]
)
def test_a_plan_taken_back_leaves_the_program_as_it_was(monkeypatch, build, scale):
    """Where the scaled fp32 program's outputs move (a rule that does not commute as its
    table says), every change is taken back: the multiplies at the door and before the
    readers, the folded tensors, the scaled scalars, the exponents on the values. The
    cast then is the one without scale domains, graph and state alike."""
    import fx16.passes.scale_domains as scale_pass

    torch.manual_seed(0)
    model = build().eval()
    x = (torch.rand(8, 16) if build is RawUnits else torch.randn(2, *_input_shape(build))) * scale
    plain = fx16.cast_fp32_to_fp16(export(model, x), policy=NO_SCALING)
    monkeypatch.setattr(scale_pass, "same_outputs", lambda reference, outputs: False)
    taken_back = fx16.cast_fp32_to_fp16(export(model, x))
    assert scale_pass.REVERTED in taken_back.graph_module.meta
    assert taken_back.graph_module.code == plain.graph_module.code
    for name, tensor in plain.state_dict.items():
        assert torch.equal(taken_back.state_dict[name], tensor), name
    assert not [n for n in taken_back.graph.nodes if meta.RANGE_SCALE in n.meta]
    assert not [n for n in taken_back.graph.nodes if meta.SCALE_EXPONENT in n.meta]


def _input_shape(build) -> tuple[int, ...]:
    return {LayerNormResidual: (16,), GrowingCnn: (8, 8, 8)}[build]
