"""The accuracy budget: the fewest nodes back to fp32 until outputs are close enough."""

import pytest
import torch
import torch.utils._pytree as pytree
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
import fx16.accuracy.remedies
from benchmarks.zoo import ScaledAttention, t5_encoder
from fx16.accuracy.remedies import Reference, reference_outputs, remedies
from fx16.decisions import PRECISION, Reason
from fx16.program import Program
from fx16.program.cost import is_product
from fx16.program.stats import relative_error
from fx16.report import report_of
from fx16.testing.strategies import programs
from helpers import check_program, export, run


def SharpSoftmax(scale=3.0):  # noqa: N802 - reads like the class it builds
    """Attention with unscaled, large logits: fp16 rounding of q and k moves the softmax."""
    return ScaledAttention(width=32, scale=scale)


def _calibration(count, seed):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 8, 32, generator=generator),) for _ in range(count)]


def _unseen_error(model, ep, inputs):
    with torch.no_grad():
        return max(relative_error(model(*args), run(ep, *args)[0]) for args in inputs)


def test_budget_returns_a_few_nodes_to_fp32_and_holds_on_unseen_inputs():
    torch.manual_seed(0)
    model = SharpSoftmax().eval()
    calibration, unseen = _calibration(3, 1), _calibration(4, 2)
    plain = fx16.cast_fp32_to_fp16(export(model, *calibration[0]), calibration=calibration)
    assert _unseen_error(model, plain, unseen) > 2e-3  # the plain cast misses the budget

    ep = fx16.cast_fp32_to_fp16(
        export(model, *calibration[0]), calibration=calibration, max_rel_error=2e-3
    )
    check_program(ep)
    search = report_of(ep).accuracy
    assert search.met and search.error <= 2e-3
    assert _unseen_error(model, ep, unseen) <= 2e-3
    assert search.fp32_nodes
    assert search.rounds + 1 <= search.evaluations <= 40  # one run a round, plus bisection
    for name in search.fp32_nodes:
        node = next((n for n in ep.graph_module.graph.nodes if n.name == name), None)
        if node is not None and PRECISION in node.meta:
            assert node.meta[PRECISION].reason == Reason.ACCURACY_FALLBACK
    assert "p_v_weight" not in search.fp32_nodes  # the value path is insensitive
    assert report_of(ep).totals.float_ops_16bit > 0


def test_one_calibration_input_is_enough_for_unseen_inputs():
    # Rounding errors that cancel on the one input the search sees must not look harmless.
    torch.manual_seed(0)
    model = SharpSoftmax(scale=4.0).eval()
    calibration, unseen = _calibration(1, 7), _calibration(4, 8)
    ep = fx16.cast_fp32_to_fp16(
        export(model, *calibration[0]), calibration=calibration, max_rel_error=2e-3
    )
    assert report_of(ep).accuracy.met
    assert _unseen_error(model, ep, unseen) <= 2e-3


def test_a_value_returned_to_fp32_for_one_use_stays_16_bit_for_the_others():
    torch.manual_seed(0)
    model = SharpSoftmax().eval()
    calibration = _calibration(2, 1)
    ep = fx16.cast_fp32_to_fp16(
        export(model, *calibration[0]), calibration=calibration, max_rel_error=2e-3
    )
    search = report_of(ep).accuracy
    assert "x" in search.fp32_nodes  # the q/k path reads the input unrounded...
    nodes = {node.name: node for node in ep.graph_module.graph.nodes}
    assert nodes["x"].meta["val"].dtype == torch.float32
    assert "linear_2" not in search.fp32_nodes  # ...the value path reads it in fp16
    (value_input,) = [arg for arg in nodes["linear_2"].args if arg.op != "placeholder"]
    assert value_input.args[0] is nodes["x"]
    assert nodes["linear_2"].meta["val"].dtype == torch.float16


def test_budget_already_met_changes_nothing_more():
    torch.manual_seed(0)
    model = SharpSoftmax(scale=1.0).eval()
    calibration = _calibration(2, 1)
    ep = fx16.cast_fp32_to_fp16(
        export(model, *calibration[0]), calibration=calibration, max_rel_error=5e-2
    )
    search = report_of(ep).accuracy
    assert search.rounds == 0 and search.fp32_nodes == () and search.evaluations == 1


def test_a_plain_cast_within_the_budget_is_kept_and_the_target_is_printed():
    """The plain cast's calibration error is a fair sample (nothing was chosen to fit
    those inputs): within the budget, it is kept, even on one input where a search
    would aim at half the budget. With ``target_share`` the caller asks for a margin,
    and the search runs to it; the summary prints the target either way."""
    torch.manual_seed(0)
    model = SharpSoftmax(scale=3.0).eval()
    calibration = _calibration(1, 1)
    plain = fx16.cast_fp32_to_fp16(export(model, *calibration[0]), calibration=calibration)
    with torch.no_grad():
        error = relative_error(model(*calibration[0]), run(plain, *calibration[0])[0])
    budget = 1.2 * error  # met, but above half of it (stopping_share of one input)
    kept = report_of(
        fx16.cast_fp32_to_fp16(
            export(model, *calibration[0]), calibration=calibration, max_rel_error=budget
        )
    )
    assert kept.accuracy.plain_kept and kept.accuracy.evaluations == 1
    assert kept.accuracy.plain_error == kept.accuracy.error <= budget
    assert "the plain cast meets it and is kept" in "\n".join(kept.summary())
    assert kept.totals.flop_share_16bit == 1.0
    searched = report_of(
        fx16.cast_fp32_to_fp16(
            export(model, *calibration[0]),
            calibration=calibration,
            max_rel_error=budget,
            target_share=0.5,
        )
    )
    assert searched.accuracy.fp32_nodes and searched.accuracy.error <= 0.5 * budget
    assert searched.accuracy.target == pytest.approx(0.5 * budget)
    assert f"target {0.5 * budget:.3g}; plain cast {error:.3g})" in "\n".join(searched.summary())
    with pytest.raises(fx16.InvalidOptionError, match="target_share needs max_rel_error"):
        fx16.cast_fp32_to_fp16(export(model, *calibration[0]), target_share=0.5)


def test_a_zero_budget_is_reached_by_returning_everything_that_matters():
    torch.manual_seed(0)
    model = SharpSoftmax().eval()
    calibration = _calibration(1, 1)
    ep = fx16.cast_fp32_to_fp16(
        export(model, *calibration[0]), calibration=calibration, max_rel_error=0.0
    )
    check_program(ep)
    assert report_of(ep).accuracy.met and report_of(ep).accuracy.error == 0.0


def _search_on_one_input(model_class, budget):
    """Cast a fresh ``model_class()`` within ``budget`` on one calibration input; the
    search's record, once the program is checked."""
    torch.manual_seed(0)
    model = model_class().eval()
    calibration = _calibration(1, 1)
    ep = fx16.cast_fp32_to_fp16(
        export(model, *calibration[0]), calibration=calibration, max_rel_error=budget
    )
    check_program(ep)
    return report_of(ep).accuracy


def test_a_search_out_of_evaluations_returns_everything_to_fp32(monkeypatch):
    monkeypatch.setattr(fx16.accuracy.budget, "_MOST_EVALUATIONS", 1)
    search = _search_on_one_input(SharpSoftmax, 1e-6)
    assert search.met and search.error <= 1e-6 and search.evaluations == 2


def test_a_budget_the_caller_makes_impossible_raises_and_leaves_the_program():
    # Even all-fp32 cannot beat noise the program itself adds: refuse, do not return it.
    torch.manual_seed(0)
    model = SharpSoftmax().eval()
    calibration = _calibration(1, 1)
    ep = export(model, *calibration[0])
    before = str(ep.graph_module.graph)
    with pytest.raises(fx16.AccuracyBudgetError, match="cannot be met"):
        fx16.cast_fp32_to_fp16(
            ep, calibration=calibration, max_rel_error=1e-3, metric=lambda ref, out: 1.0
        )
    assert str(ep.graph_module.graph) == before


def test_budget_needs_inputs():
    ep = export(SharpSoftmax(), *_calibration(1, 1)[0])
    ep.example_inputs = None
    with pytest.raises(fx16.InvalidOptionError, match="max_rel_error needs inputs"):
        fx16.cast_fp32_to_fp16(ep, max_rel_error=1e-2)


def test_t5_encoder_meets_the_budget_on_unseen_inputs_with_most_flops_16_bit():
    """A T5-style encoder from a transformers config (random weights, larger init so
    fp16 misses the budget). The search pays for accuracy by cost: cheap elementwise
    ops and reductions go back to fp32 first, so most product FLOPs stay 16-bit."""
    torch.manual_seed(0)
    model = t5_encoder(initializer_factor=2.0)

    generator = torch.Generator().manual_seed(3)
    draw = lambda: (torch.randint(0, 512, (2, 12), generator=generator),)  # noqa: E731
    calibration, unseen = [draw() for _ in range(4)], [draw() for _ in range(4)]
    budget = 1e-2
    plain = fx16.cast_fp32_to_fp16(export(model, *calibration[0]), calibration=calibration)
    assert _unseen_error(model, plain, unseen) > budget
    ep = fx16.cast_fp32_to_fp16(
        export(model, *calibration[0]), calibration=calibration, max_rel_error=budget
    )
    check_program(ep)
    assert _unseen_error(model, ep, unseen) <= budget
    report = report_of(ep)
    assert report.totals.flop_share_16bit >= 0.85
    assert report.accuracy.flop_share_16bit == report.totals.flop_share_16bit
    (said,) = [line for line in report.summary() if line.startswith("accuracy:")]
    assert "of matmul/conv/attention FLOPs in 16-bit" in said


@settings(max_examples=examples(3), deadline=None)
@given(programs(), st.sampled_from([0.0, 1e-4, 1e-2]))
def test_property_a_budget_is_met_on_the_calibration_inputs_or_refused(case, budget):
    ep = case.export()
    before = str(ep.graph_module.graph)
    expected = run(case.export(), *case.args)
    try:
        fx16.cast_fp32_to_fp16(ep, calibration=[case.args], max_rel_error=budget)
    except fx16.AccuracyBudgetError:
        assert str(ep.graph_module.graph) == before  # refused: the program is as it was
        return
    check_program(ep)
    search = report_of(ep).accuracy
    assert search.met and search.evaluations <= 40
    for want, have in zip(expected, run(ep, *case.args)):
        if want.is_floating_point() and torch.isfinite(want).all():
            assert relative_error(want, have.to(want.dtype)) <= budget


class _NoDerivative(torch.nn.Module):
    """Sharp attention after a custom op that has no autograd formula."""

    def __init__(self):
        super().__init__()
        self.attention = SharpSoftmax()

    def forward(self, x):
        return self.attention(torch.ops.fx16_test.scaled_to(x, 2.0, torch.float32))


def test_an_op_without_a_derivative_still_lets_the_budget_be_met():
    import fx16.testing.custom_ops  # noqa: F401  (registers fx16_test::scaled_to, which has no backward)

    search = _search_on_one_input(_NoDerivative, 2e-3)
    assert search.met and search.error <= 1e-3  # half the budget: one calibration input
    assert search.evaluations <= 40


def test_the_search_keeps_no_copy_of_the_weights(monkeypatch):
    """The reference's autograd graph reads the program's fp32 weights themselves (no
    clone per round or per input), and only the tape's activations are kept."""
    torch.manual_seed(0)
    model = SharpSoftmax().eval()
    calibration = _calibration(2, 1)
    ep = export(model, *calibration[0])
    weights = {t.untyped_storage().data_ptr() for t in ep.state_dict.values()}
    taped = []
    make_tape = fx16.accuracy.remedies.Reference._tape

    def recording(self, inputs):
        tape = make_tape(self, inputs)
        taped.append(tape)
        return tape

    monkeypatch.setattr(fx16.accuracy.remedies.Reference, "_tape", recording)
    fx16.cast_fp32_to_fp16(ep, calibration=calibration, max_rel_error=2e-3)
    assert len(taped) == len(calibration)  # one tape per input, built once
    for _, _, _, values in taped:
        storages = {v.untyped_storage().data_ptr() for v in values.values()}
        assert weights <= storages  # the weights as they are, not copies


def test_gradients_taken_in_small_groups_give_the_same_search(monkeypatch):
    """Bounding the gradients held at once (one backward run per group of uses) changes
    the cost of a round, not its outcome."""
    torch.manual_seed(0)
    model = SharpSoftmax().eval()
    calibration = _calibration(2, 1)

    def search():
        ep = export(model, *calibration[0])
        fx16.cast_fp32_to_fp16(ep, calibration=calibration, max_rel_error=2e-3)
        return report_of(ep).accuracy

    whole = search()
    monkeypatch.setattr(fx16.accuracy.remedies, "_GRADIENT_ELEMENTS", 64)
    grouped = search()
    assert whole.fp32_nodes == grouped.fp32_nodes and whole.evaluations == grouped.evaluations
    assert grouped.error == pytest.approx(whole.error)


class CancellingProducts(torch.nn.Module):
    """Two nearly equal linear layers subtracted, then a gate: the products' 16-bit
    rounding is most of the error, the elementwise ops' a little of it."""

    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.fc2.weight.copy_(self.fc.weight + 1e-3 * torch.randn(8, 8))
            self.fc2.bias.copy_(self.fc.bias)

    def forward(self, x):
        return (self.fc(x) - self.fc2(x)) * torch.sigmoid(x)


def test_remedies_that_move_no_product_come_before_any_that_does():
    """Where a product's rounding scores far more per FLOP than any elementwise op's,
    the remedies still rank every elementwise op and reduction first."""
    torch.manual_seed(0)
    model = CancellingProducts().eval()
    calibration = [(torch.randn(4, 8),) for _ in range(2)]
    ep = fx16.cast_fp32_to_fp16(export(model, *calibration[0]), calibration=calibration)
    program = Program(ep)
    inputs = [program.graph_inputs(*program.adapt_call(args, {})) for args in calibration]
    reference_ep = export(model, *calibration[0])
    reference_inputs = [Program(reference_ep).graph_inputs(args, {}) for args in calibration]
    module = reference_ep.graph_module
    outputs = [reference_outputs(module, each) for each in reference_inputs]
    reference = Reference(module, reference_inputs, outputs, set())
    with torch.no_grad():
        observed = [pytree.tree_leaves(ep.graph_module(*each)) for each in inputs]
    ranked = remedies(ep.graph_module, reference, observed, set())
    nodes = {node.name: node for node in module.graph.nodes}
    moves = [any(name in nodes and is_product(nodes[name]) for name in fix) for _, fix in ranked]
    assert False in moves and True in moves
    assert moves == sorted(moves)  # every False (no product) before the first True
