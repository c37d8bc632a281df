"""PrecisionPolicy: presets, overrides, keep_io_types, and the static autocast."""

import copy
import math
import operator
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fx16
from benchmarks.zoo import ResNetish
from fx16 import OpKind, Precision, PrecisionPolicy
from fx16.decisions import PRECISION, Reason
from fx16.demo import DemoBlock
from fx16.ops.autocast import AUTOCAST_CPU, AUTOCAST_CUDA
from fx16.ops.kinds import op_kind
from fx16.policy import POLICY_PRESETS
from fx16.program import Program
from fx16.report import report_of
from fx16.testing.strategies import model_cases
from helpers import (
    DtypeRecorder,
    assert_same_state,
    casts,
    check_program,
    export,
    fp64_reference,
    max_error,
    node_named,
    run,
    state_snapshot,
)

aten = torch.ops.aten


def _block():
    torch.manual_seed(0)
    model = DemoBlock(vocab=64, width=32).eval()
    return model, (torch.randint(0, 64, (2, 8)),)


def _dtypes_by_kind(ep) -> dict:
    found: dict = {}
    for node in ep.graph_module.graph.nodes:
        decision = node.meta.get(PRECISION)
        if (
            node.op == "call_function"
            and decision is not None
            and not node.meta.get("fx16.inserted")
        ):
            found.setdefault(op_kind(node), set()).add(decision.dtype)
    return found


def test_always_fp32_changes_nothing():
    model, args = _block()
    ep = export(model, *args)
    before = state_snapshot(ep)
    fx16.cast_fp32_to_fp16(ep, policy="always_fp32")
    assert before[0][""] == ep.graph_module.code
    assert all(t.dtype == torch.float32 for t in ep.state_dict.values())


def test_always_fp16_puts_every_kind_in_fp16():
    model, args = _block()
    ep = fx16.cast_fp32_to_fp16(export(model, *args), policy=PrecisionPolicy.always_fp16())
    check_program(ep)
    for kind, dtypes in _dtypes_by_kind(ep).items():
        assert dtypes == {torch.float16}, kind
    assert max_error(fp64_reference(model, *args), run(ep, *args)) < 1e-2


def test_conservative_keeps_reductions_fp32_and_costs_more_casts():
    model, args = _block()
    conservative = fx16.cast_fp32_to_fp16(export(model, *args), policy="auto_mixed_conservative")
    mixed = fx16.cast_fp32_to_fp16(export(model, *args), policy="auto_mixed")
    check_program(conservative)
    kinds = _dtypes_by_kind(conservative)
    assert kinds[OpKind.REDUCTION] == {torch.float32}
    assert kinds[OpKind.COMPUTE] == {torch.float16}
    softmax = next(n for n in conservative.graph_module.graph.nodes if n.target == aten.softmax.int)
    assert softmax.meta[PRECISION].reason == Reason.POLICY
    assert len(casts(mixed)) < len(casts(conservative))
    assert max_error(fp64_reference(model, *args), run(conservative, *args)) < 1e-2


def test_bf16_preset_casts_weights_beyond_65504():
    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.full((4,), 1e5))

        def forward(self, x):
            return x * self.scale

    x = torch.randn(2, 4)
    ep = fx16.cast_fp32_to_fp16(export(Big(), x), policy="auto_mixed_bf16")
    check_program(ep)
    assert ep.state_dict["scale"].dtype == torch.bfloat16
    assert run(ep, x)[0].dtype == torch.bfloat16
    default = fx16.cast_fp32_to_fp16(export(Big(), x))
    # fp16 cannot hold 1e5: a scale domain folds 2**-2 into it, undone at the output
    assert default.state_dict["scale"].dtype == torch.float16
    exponent = math.log2(1e5 / float(default.state_dict["scale"][0]))
    assert abs(exponent - round(exponent)) < 1e-3 and round(exponent) > 0
    assert max_error([Big()(x)], run(default, x)) < 2e-3


class Mix(torch.nn.Module):
    """linear, softmax, layer_norm, sum, cat, exp and matmul."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        h = self.fc(x)
        attention = h.softmax(-1)
        total = self.norm(h).sum(-1, keepdim=True)
        joined = torch.cat([attention, x], -1)
        return joined.exp() @ joined.transpose(-1, -2) + total


@pytest.mark.parametrize("decompose", [False, True])
def test_static_autocast_matches_eager_autocast_op_by_op(decompose):
    torch.manual_seed(0)
    model, x = Mix().eval(), torch.randn(2, 3, 8)
    ep = export(model, x, decompose=decompose)
    recorder = DtypeRecorder(ep.graph_module)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = recorder.run(*Program(ep).graph_inputs((x,)))[0]
    cast = fx16.cast_fp32_to_fp16(
        copy.deepcopy(ep), policy=PrecisionPolicy.autocast("cpu", torch.bfloat16)
    )
    check_program(cast)
    compared = 0
    for node in cast.graph_module.graph.nodes:
        if node.name in recorder.dtypes and not node.meta.get("fx16.inserted"):
            assert node.meta["val"].dtype == recorder.dtypes[node.name], node.name
            compared += 1
    assert compared >= 10
    got = run(cast, x)[0]
    assert got.dtype == eager.dtype
    torch.testing.assert_close(got.float(), eager.float(), rtol=2e-2, atol=2e-2)


def test_overrides_by_module_and_op_and_node():
    model, args = _block()
    policy = PrecisionPolicy.custom(
        modules={"up": "fp32", "head": "fp32"}, ops={"gelu": "fp32"}, nodes={"linear": "fp32"}
    )
    ep = fx16.cast_fp32_to_fp16(export(model, *args), policy=policy)
    check_program(ep)
    assert ep.state_dict["up.weight"].dtype == torch.float32
    assert ep.state_dict["head.weight"].dtype == torch.float32
    assert ep.state_dict["down.weight"].dtype == torch.float16
    by_name = {n.name: n for n in ep.graph_module.graph.nodes}
    assert by_name["gelu"].meta[PRECISION].reason == Reason.POLICY
    assert by_name["linear"].meta[PRECISION].reason == Reason.POLICY
    up = next(n for n in ep.graph_module.graph.nodes if n.name == "linear_2")
    assert up.meta["val"].dtype == torch.float32


@pytest.mark.parametrize("decompose", [False, True])
@pytest.mark.parametrize("keep", [True, ["x"]])
def test_keep_io_types(decompose, keep):
    torch.manual_seed(0)
    model, x = Mix().eval(), torch.randn(2, 3, 8)
    ep = export(model, x, decompose=decompose)
    output_name = ep.graph_module.graph.output_node().args[0][0].name
    names = keep if keep is True else [*keep, output_name]
    ep = fx16.cast_fp32_to_fp16(ep, policy=PrecisionPolicy.custom(keep_io_types=names))
    check_program(ep)
    assert ep.example_inputs[0][0].dtype == torch.float32
    assert run(ep, x)[0].dtype == torch.float32
    assert report_of(ep).totals.float_ops_16bit > 0
    assert max_error(fp64_reference(model, x), run(ep, x)) < 1e-2


def test_unknown_names_are_refused():
    with pytest.raises(fx16.InvalidOptionError, match="unknown policy"):
        PrecisionPolicy.named("fastest")
    with pytest.raises(fx16.InvalidOptionError, match="unknown precision"):
        PrecisionPolicy.custom(ops={"softmax": "fp8"})


@pytest.mark.parametrize("key", [OpKind.REDUCTION, "reduction", "REDUCTION", "Reduction"])
def test_a_kind_is_named_by_its_member_value_or_name_in_any_case(key):
    """kinds={"REDUCTION": "fp32"} once passed and did nothing: every spelling of a kind
    the enum has now reaches it."""
    policy = PrecisionPolicy.custom(kinds={key: "fp32"})
    assert policy.kinds[OpKind.REDUCTION] is Precision.FP32
    assert policy.kinds[OpKind.COMPUTE] is Precision.LOW


@pytest.mark.parametrize(
    ("key", "message"),
    [("bogus", "kinds: compute, reduction"), (42, "42"), ("reductions", "closest: reduction")],
)
def test_a_kinds_key_that_names_no_kind_is_refused(key, message):
    with pytest.raises(fx16.InvalidOptionError, match=f"kinds names no op kind.*{message}"):
        PrecisionPolicy.custom(kinds={key: "fp32"})


precisions = st.sampled_from(["16-bit", "fp32"])
policies = st.builds(
    lambda kinds, low: PrecisionPolicy.custom(kinds=kinds, low=low),
    st.dictionaries(st.sampled_from(list(OpKind)), precisions),
    st.sampled_from([torch.float16, torch.bfloat16]),
)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_cases, policies)
def test_random_policies_are_obeyed_where_safety_rules_do_not_claim_a_node(case, policy):
    model, args = case
    ep = fx16.cast_fp32_to_fp16(export(model, *args), policy=policy)
    check_program(ep)
    for node in ep.graph_module.graph.nodes:
        decision = node.meta.get(PRECISION)
        if decision is None or node.meta.get("fx16.inserted") or node.op != "call_function":
            continue
        if node.target is operator.getitem:  # an element follows the op that made it
            continue
        wanted = policy.precision_for(node)
        if decision.reason == Reason.FITS:
            assert wanted == Precision.LOW, node.name
            assert decision.dtype == policy.low
        if decision.reason == Reason.POLICY:
            assert wanted == Precision.FP32, node.name


LOW16, FP32 = torch.float16, torch.float32
EXPECTED_BY_KIND = {
    "default": dict.fromkeys(OpKind, LOW16),
    "auto_mixed": dict.fromkeys(OpKind, LOW16),
    "auto_mixed_conservative": {**dict.fromkeys(OpKind, LOW16), OpKind.REDUCTION: FP32},
    "auto_mixed_bf16": dict.fromkeys(OpKind, torch.bfloat16),
}


@pytest.mark.parametrize("preset", sorted(EXPECTED_BY_KIND))
def test_each_preset_gives_each_op_kind_its_dtype(preset):
    """Every op the policy decided (not a safety rule) has its kind's dtype."""
    model, args = _block()
    ep = fx16.cast_fp32_to_fp16(export(model, *args), policy=preset)
    check_program(ep)
    checked = 0
    for node in ep.graph_module.graph.nodes:
        decision = node.meta.get(PRECISION)
        if node.op != "call_function" or node.meta.get("fx16.inserted") or decision is None:
            continue
        if decision.reason in (Reason.FITS, Reason.POLICY) and node.target is not operator.getitem:
            assert decision.dtype == EXPECTED_BY_KIND[preset][op_kind(node)], node.name
            checked += 1
    assert checked > 10
    assert max_error(fp64_reference(model, *args), run(ep, *args)) < 2e-2


def test_op_keys_may_be_aten_ops():
    policy = PrecisionPolicy.custom(ops={aten.softmax.int: "fp32"})
    assert policy.ops == {"softmax": Precision.FP32}


def test_autocast_tables_name_real_ops_and_the_overloads_torch_registers():
    """Every entry is an ATen op (an overload where autocast registers only one): CPU
    autocast takes ``_convolution.deprecated`` alone, and ``_grid_sampler_2d_cpu_fallback``
    is in its fp32 list."""
    for table in (AUTOCAST_CPU, AUTOCAST_CUDA):
        for names in table.values():
            for name in names:
                packet, _, overload = name.partition(".")
                assert hasattr(torch.ops.aten, packet), name
                assert not overload or overload in getattr(torch.ops.aten, packet).overloads()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    convolution_args = (x, x, None, [1], [0], [1], False, [0], 1, False, False, True)
    deprecated = graph.call_function(aten._convolution.deprecated, convolution_args[:-1])
    current = graph.call_function(aten._convolution.default, convolution_args)
    fallback = graph.call_function(aten._grid_sampler_2d_cpu_fallback.default, (x, x, 0, 0, False))
    policy = PrecisionPolicy.autocast("cpu", torch.bfloat16)
    assert policy.matching_entry(deprecated) == (
        Precision.LOW,
        "op_table['_convolution.deprecated'] = 16-bit",
    )
    assert policy.precision_for(current) == Precision.FOLLOW
    assert policy.precision_for(fallback) == Precision.FP32


def test_an_op_table_entry_may_name_one_overload():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    by_dim = graph.call_function(aten.softmax.int, (x, -1))
    policy = PrecisionPolicy.custom(ops={"softmax.int": "fp32"})
    assert policy.precision_for(by_dim) == Precision.FP32
    assert PrecisionPolicy.custom(ops={"softmax.Dimname": "fp32"}).precision_for(by_dim) == (
        Precision.LOW
    )


class _CreatedOperand(torch.nn.Module):
    def forward(self, x):
        return torch.mm(x, torch.eye(8)) + torch.nn.functional.prelu(x, torch.ones(1))


@pytest.mark.parametrize("preset", sorted(set(POLICY_PRESETS) - {"always_fp32"}))
def test_a_product_of_a_tensor_made_in_forward_runs_16_bit_where_the_policy_says_so(preset):
    """``torch.mm(x, torch.eye(8))``: the eye is an fp32 tensor the program makes, and
    a 16-bit product reads it through a cast, as eager autocast does."""
    policy = PrecisionPolicy.named(preset)
    x = torch.randn(4, 8)
    ep = fx16.cast_fp32_to_fp16(export(_CreatedOperand(), x), policy=policy)
    check_program(ep)
    for name in ("mm", "prelu"):
        assert node_named(ep, name).meta["val"].dtype == policy.low, name
    torch.testing.assert_close(run(ep, x)[0].float(), x + x, rtol=1e-2, atol=1e-2)


def test_static_autocast_on_a_decomposed_cnn():
    """Decomposed, conv2d is aten.convolution, which no CPU autocast list names: it follows
    its inputs, and as a convolution cannot mix bf16 input with fp32 weights it runs in the
    wider dtype."""
    torch.manual_seed(0)
    model, x = ResNetish().eval(), torch.randn(1, 3, 16, 16)
    ep = fx16.cast_fp32_to_fp16(
        export(model, x, decompose=True), policy=PrecisionPolicy.autocast("cpu", torch.bfloat16)
    )
    check_program(ep)
    assert max_error(fp64_reference(model, x), run(ep, x)) < 5e-2


@pytest.mark.parametrize(
    "policy",
    [
        PrecisionPolicy.default(),
        PrecisionPolicy.auto_mixed_conservative(),
        PrecisionPolicy.autocast(),
        PrecisionPolicy.custom(ops={"gelu": "fp32", "mm": "follow"}),
        PrecisionPolicy.custom(modules={"stem": "fp32"}, nodes={"relu": "fp32"}),
    ],
    ids=["default", "conservative", "autocast", "by-op", "by-module-and-node"],
)
def test_precision_for_answers_each_node_as_its_matching_entry_does(policy):
    """precision_for keeps an op's answer for its other nodes where only op names and
    kinds decide: every node still gets what matching_entry names; a copy and a pickled
    policy answer the same."""
    ep = export(ResNetish().eval(), torch.randn(1, 3, 16, 16))
    nodes = [n for n in ep.graph.nodes if n.op in ("call_function", "placeholder")]
    for candidate in (policy, copy.deepcopy(policy), pickle.loads(pickle.dumps(policy))):
        for _ in range(2):  # the second round reads what the first kept
            for node in nodes:
                assert candidate.precision_for(node) == candidate.matching_entry(node)[0]


@pytest.mark.parametrize(
    "target, explicit_fp32, range_fallback",
    [("cpu", "keep", "fp32"), ("gpu", "keep", "bf16"), ("neural_engine", "calibrated", "fp32")],
)
def test_a_target_sets_the_settings_it_trades(target, explicit_fp32, range_fallback):
    """target= sets what its cost trades against accuracy; an explicit setting wins."""
    from fx16.policy import resolve_policy

    policy = resolve_policy(None, target=target)
    assert (policy.explicit_fp32, policy.range_fallback) == (explicit_fp32, range_fallback)
    explicit = resolve_policy(None, target=target, explicit_fp32="retarget", range_fallback="fp32")
    assert (explicit.explicit_fp32, explicit.range_fallback) == ("retarget", "fp32")
    assert resolve_policy("auto_mixed", target=target).name == "auto_mixed"


def test_the_neural_engine_target_keeps_a_region_only_on_evidence():
    """An RMSNorm's fp32 region whose values fit: kept by default (as .half() keeps it),
    retargeted to 16-bit for the Neural Engine, where every fp32 op leaves the
    accelerator; the report's provenance names the target."""
    from models import RMSNormMLP

    torch.manual_seed(0)
    model, x = RMSNormMLP().eval(), torch.randn(3, 16)
    kept = fx16.cast_fp32_to_fp16(export(model, x))
    engine = fx16.cast_to_16_bit_precision(export(model, x), target="neural_engine")
    assert {row.rule for row in report_of(kept).rows} & {"explicit_fp32"}
    assert not {row.rule for row in report_of(engine).rows} & {"explicit_fp32"}
    assert report_of(engine).provenance["options"]["target"] == "neural_engine"


def test_cast_to_16_bit_precision_defaults_to_the_neural_engine():
    """coreai-opt's entry point, called as coreai-opt's users call it, casts for the
    Neural Engine: the model's own fp32 region goes 16-bit, as coreai-opt's does. A target
    or policy the caller names wins, and ``cast_fp32_to_fp16`` keeps its default."""
    from models import RMSNormMLP

    torch.manual_seed(0)
    model, x = RMSNormMLP().eval(), torch.randn(3, 16)

    def kept(ep) -> bool:
        return "explicit_fp32" in {row.rule for row in report_of(ep).rows}

    drop_in = fx16.cast_to_16_bit_precision(export(model, x))
    assert not kept(drop_in)
    assert report_of(drop_in).provenance["options"]["target"] == "neural_engine"
    assert kept(fx16.cast_to_16_bit_precision(export(model, x), target="cpu"))
    assert kept(fx16.cast_to_16_bit_precision(export(model, x), policy="default"))
    assert kept(fx16.cast_fp32_to_fp16(export(model, x)))


def test_an_unknown_target_is_refused_and_changes_nothing():
    from models import RMSNormMLP

    ep = export(RMSNormMLP().eval(), torch.randn(3, 16))
    before = state_snapshot(ep)
    with pytest.raises(fx16.InvalidOptionError, match="target.*neural_engine"):
        fx16.cast_fp32_to_fp16(ep, target="npu")
    assert_same_state(before, state_snapshot(ep))
