"""Higher-order regions: autocast on and off, cond branches, and other bodies."""

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from fx16.decisions import PRECISION, Reason
from fx16.passes import CleanupCastsPass
from fx16.report import report_of
from helpers import check_program, export, fp64_reference, max_error, run
from models import AutocastRegions, Branches, GrowingLoop, MappedLayer

aten = torch.ops.aten


def _hops(ep, target):
    return [n for n in ep.graph_module.graph.nodes if n.target is target]


@pytest.mark.parametrize("strict", [False, True])
def test_autocast_regions_keep_their_meaning(strict):
    torch.manual_seed(0)
    model, x = AutocastRegions(), torch.randn(3, 8)
    ep = torch.export.export(model.eval(), (x,), strict=strict)
    if strict:  # strict export records fp32 for the fp16 region: the program cannot run as is
        with pytest.warns(RuntimeWarning, match="example inputs"):
            fx16.cast_fp32_to_fp16(ep)
    else:
        fx16.cast_fp32_to_fp16(ep)
    check_program(ep)
    disabled, enabled = _hops(ep, torch.ops.higher_order.wrap_with_autocast)
    assert disabled.meta[PRECISION].reason == Reason.AUTOCAST_DISABLED
    assert all(a.meta["val"].dtype == torch.float32 for a in disabled.args[5:])
    assert enabled.meta[PRECISION].reason == Reason.AUTOCAST_REGION
    assert enabled.args[5].meta["val"].dtype == torch.float16  # fed as it is
    assert max_error(fp64_reference(model, x), run(ep, x)) < 1e-2


def test_cond_branches_are_cast_and_agree_on_dtypes():
    """positive branch: exp * 0.5 in fp16; negative: a * 1e5 in fp32; both return fp32."""
    torch.manual_seed(0)
    model = Branches()
    x = torch.randn(2, 4)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    (cond,) = _hops(ep, torch.ops.higher_order.cond)
    positive = getattr(ep.graph_module, cond.args[1].target)
    negative = getattr(ep.graph_module, cond.args[2].target)
    exp = next(n for n in positive.graph.nodes if n.target == aten.exp.default)
    assert exp.meta["val"].dtype == torch.float16
    mul = next(n for n in negative.graph.nodes if n.target == aten.mul.Tensor)
    assert mul.meta[PRECISION].reason == Reason.SCALAR_OVERFLOW
    dtypes = {
        out.meta["val"].dtype
        for body in (positive, negative)
        for out in body.graph.output_node().args[0]
    }
    assert dtypes == {torch.float32}
    for sign in (1.0, -1.0):
        with torch.no_grad():
            model.fc.bias.fill_(5.0 * sign)
        ep = fx16.cast_fp32_to_fp16(export(model, x))
        assert max_error(fp64_reference(model, x), run(ep, x)) < 1e-2


def test_failure_restores_subgraphs_too(monkeypatch):
    torch.manual_seed(0)
    ep = export(Branches(), torch.randn(2, 4))
    (cond,) = _hops(ep, torch.ops.higher_order.cond)
    positive = getattr(ep.graph_module, cond.args[1].target)
    code = positive.code

    def fail(self, graph_module):
        raise RuntimeError("injected")

    monkeypatch.setattr(CleanupCastsPass, "call", fail)
    with pytest.raises(fx16.PassFailedError):
        fx16.cast_fp32_to_fp16(ep)
    assert getattr(ep.graph_module, cond.args[1].target).code == code


class BranchEnergy(torch.nn.Module):
    """The taken branch squares large values (beyond fp16) and takes a root again."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.bias.fill_(3.0)

    def forward(self, x):
        h = self.fc(x)

        def energy(a):
            return (a * 300).pow(2).sum(-1, keepdim=True).sqrt()

        def plain(a):
            return a.abs()

        return torch.cond(h.sum() > 0, energy, plain, (h,))


def test_calibration_looks_inside_the_branch_taken():
    """pow inside the taken branch overflows fp16: it is observed and kept fp32 there."""
    torch.manual_seed(0)
    model, x = BranchEnergy(), torch.randn(2, 4)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    (cond,) = _hops(ep, torch.ops.higher_order.cond)
    taken = getattr(ep.graph_module, cond.args[1].target)
    power = next(n for n in taken.graph.nodes if n.target == aten.pow.Tensor_Scalar)
    assert power.meta["fx16.observed_range"] > 65504
    assert power.meta[PRECISION].reason == Reason.ACTIVATION_OVERFLOW
    outputs = run(ep, x)
    assert torch.isfinite(outputs[0]).all()
    assert max_error(fp64_reference(model, x), outputs) < 1e-2


def _body(ep, hop, position):
    (node,) = _hops(ep, hop)
    return node, getattr(ep.graph_module, node.args[position].target)


def test_a_while_loop_body_is_cast_and_its_state_keeps_its_dtype():
    torch.manual_seed(0)
    model, x = GrowingLoop().eval(), torch.randn(2, 8)
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    loop, body = _body(ep, torch.ops.higher_order.while_loop, 1)
    linear = next(n for n in body.graph.nodes if n.target == aten.linear.default)
    assert linear.meta["val"].dtype == torch.float16  # the layer runs in fp16 inside
    assert "fx16.observed_range" in linear.meta  # calibration stepped into the loop
    grown = [n for n in body.graph.nodes if n.meta.get("fx16.observed_range", 0) > 65504 / 2]
    assert grown and all(n.meta[PRECISION].reason != Reason.FITS for n in grown)
    carried = [out.meta["val"].dtype for out in body.graph.output_node().args[0]]
    assert carried[1] == torch.float32  # the loop state enters and leaves as exported
    assert loop.args[2][1].meta["val"].dtype == torch.float32
    outputs = run(ep, x)
    assert torch.isfinite(outputs[0]).all()
    assert max_error(fp64_reference(model, x), outputs) < 1e-2


def test_a_map_body_is_cast():
    torch.manual_seed(0)
    model, xs = MappedLayer().eval(), torch.randn(3, 2, 8)
    ep = fx16.cast_fp32_to_fp16(export(model, xs))
    check_program(ep)
    mapped, body = _body(ep, torch.ops.higher_order.map_impl, 0)
    linear = next(n for n in body.graph.nodes if n.target == aten.linear.default)
    assert linear.meta["val"].dtype == torch.float16
    assert mapped.meta["val"][0].dtype == torch.float16
    assert max_error(fp64_reference(model, xs), run(ep, xs)) < 1e-2


@torch.compiler.nested_compile_region
def _shared_block(x, w):
    return torch.nn.functional.gelu(x @ w) + x


class SharedBody(torch.nn.Module):
    """One body, two call sites (strict export makes it invoke_subgraph): the second
    site's input is ``scale`` times the first's."""

    def __init__(self, scale=1.0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.fc = torch.nn.Linear(16, 4)
        self.scale = scale

    def forward(self, x):
        return self.fc(_shared_block(x, self.w) + _shared_block(x * self.scale, self.w))


def _shared(scale):
    torch.manual_seed(0)
    model, x = SharedBody(scale).eval().requires_grad_(False), torch.randn(3, 16)
    ep = torch.export.export(model, (x,), strict=True)
    return model, x, fx16.cast_fp32_to_fp16(ep)


def test_a_body_two_call_sites_share_is_cast_once_in_16_bit():
    """invoke_subgraph x2 -> one body: its matmul and gelu fp16, both sites fed fp16."""
    model, x, ep = _shared(1.0)
    check_program(ep)
    sites = _hops(ep, torch.ops.higher_order.invoke_subgraph)
    assert len(sites) == 2 and len({s.args[0].target for s in sites}) == 1
    body = getattr(ep.graph_module, sites[0].args[0].target)
    matmul = next(n for n in body.graph.nodes if n.target == aten.matmul.default)
    assert matmul.meta["val"].dtype == torch.float16
    assert report_of(ep).totals.flop_share_16bit == 1.0
    assert max_error(fp64_reference(model, x), run(ep, x)) < 2e-3


def test_a_shared_body_whose_values_overflow_at_one_site_is_fp32_at_every_site():
    """The second site reads x * 3e4: beyond 65504 / 2, so the body's placeholder is fp32
    and the first site's 16-bit operand is upcast to it."""
    model, x, ep = _shared(3e4)
    check_program(ep)
    sites = _hops(ep, torch.ops.higher_order.invoke_subgraph)
    body = getattr(ep.graph_module, sites[0].args[0].target)
    first = body.graph.find_nodes(op="placeholder")[0]
    assert first.meta["val"].dtype == torch.float32
    assert all(site.args[2].meta["val"].dtype == torch.float32 for site in sites)
    assert max_error(fp64_reference(model, x), run(ep, x)) < 2e-3


class Bf16ThenDisabledRegion(torch.nn.Module):
    """The model's own fp32 cast of a bf16 value opens a region it keeps (``cos``), and
    a ``torch.autocast(enabled=False)`` region reads the same cast: its body checks that
    it is fed fp32."""

    def forward(self, x):
        y = x.bfloat16().float()
        near = y.cos()
        with torch.autocast("cpu", enabled=False):
            energy = y.float().pow(2).sum(-1, keepdim=True)
        return near, y / (energy.sqrt() + 1e-3)


@pytest.mark.parametrize("policy", ["autocast", "default"])
def test_a_disabled_autocast_region_keeps_reading_the_models_fp32_cast(policy):
    """Consumers outside the model's fp32 region read its 16-bit source, except a region
    run as exported: fed that source (bf16), its dtype check failed at run time (found by
    the long fuzz). The cast program runs and stays close to fp32."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    ep = export(Bf16ThenDisabledRegion(), x)
    reference = fp64_reference(Bf16ThenDisabledRegion(), x)
    fx16.cast_to_16_bit_precision(ep, policy=policy)
    check_program(ep)
    region = next(
        n
        for n in ep.graph_module.graph.nodes
        if n.op == "call_function" and "autocast" in str(n.target)
    )
    assert region.args[-1].meta["val"].dtype == torch.float32
    assert max_error(run(ep, x), reference) < 2e-2


class RotaryBranches(torch.nn.Module):
    """Rotary angles (positions times an fp32 inv_freq) made outside a cond and read by
    a cos in one branch, a sin in the other: the angles pass 100, where fp16's step is
    2**-4, so the conditioning rule keeps them and their cos and sin fp32."""

    def __init__(self) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
        self.register_buffer("inv_freq", inv_freq)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        angle = torch.arange(x.shape[0]).float()[:, None] * self.inv_freq
        emb = torch.cat([angle, angle], -1)
        h = self.proj(x)
        return torch.cond(h.sum() > 0, lambda h, e: h * e.cos(), lambda h, e: h * e.sin(), (h, emb))


@settings(max_examples=examples(8), deadline=None)
@given(st.integers(100, 400), st.booleans(), st.integers(0, 2**16))
def test_property_a_value_a_branch_keeps_fp32_enters_it_fp32(length, flip, seed):
    """Input: the angles kept fp32 for the cos and sin inside the branches. Output: the
    cond's operand is the fp32 angle (not a 16-bit copy the branch widens again: the
    angles rounded to fp16 put 1.3e-2 on the output, where ``.half()``, rounding only
    inv_freq, puts 1e-2), and the output is within 16-bit rounding of fp64 on both
    branches, calibrated on the input itself."""
    torch.manual_seed(seed)
    model = RotaryBranches().eval()
    x = torch.randn(length, 16, generator=torch.Generator().manual_seed(seed))
    x = -x if flip else x
    ep = fx16.cast_fp32_to_fp16(export(model, x))
    check_program(ep)
    cond = next(n for n in ep.graph.nodes if n.target is torch.ops.higher_order.cond)
    assert cond.args[3][1].meta["val"].dtype == torch.float32
    for branch in ("true_graph_0", "false_graph_0"):
        body = getattr(ep.graph_module, branch)
        angles = body.graph.find_nodes(op="placeholder")[1]
        assert angles.meta["val"].dtype == torch.float32
    for call in (x, -x):
        assert max_error(fp64_reference(model, call), run(ep, call)) < 4 * 2.0**-11
