"""Higher-order regions: autocast on and off, cond branches, and other bodies."""

import pytest
import torch

import fx16
from fx16.decisions import PRECISION, Reason
from fx16.passes import CleanupCastsPass
from helpers import check_program, export, fp64_reference, max_error, run
from models import AutocastRegions

aten = torch.ops.aten


class Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)

        def positive(a):
            return a.exp() * 0.5

        def negative(a):
            return a * 1e5  # does not fit fp16: this branch must return fp32

        return torch.cond(h.sum() > 0, positive, negative, (h,)) + 1


def _hops(ep, target):
    return [n for n in ep.graph_module.graph.nodes if n.target is target]


@pytest.mark.parametrize("strict", [False, True])
def test_autocast_regions_keep_their_meaning(strict):
    torch.manual_seed(0)
    model, x = AutocastRegions(), torch.randn(3, 8)
    ep = torch.export.export(model.eval(), (x,), strict=strict)
    if strict:  # strict export records fp32 for the fp16 region: the program cannot run as is
        with pytest.warns(RuntimeWarning, match="calibration inputs"):
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
