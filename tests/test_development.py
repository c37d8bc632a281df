"""The walk-throughs of docs/development.md work as written: the example safety rule and
the example stable rewrite, run as a pipeline would run them."""

import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.export import Dim
from torch.fx import Graph, Node

from fx16 import meta
from fx16.analysis import Fp32RulesAnalysis
from fx16.analysis.safety_rule import RuleContext
from fx16.decisions import Reason
from fx16.ops.tables import overloads
from fx16.passes import StabilizePass
from fx16.passes.stable_rewrites.matching import Builder, Rewrite, calls, is_scalar, only_user
from helpers import export

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "development.md"


def _example(name: str, **namespace) -> dict:
    """Run the code block after ``<!-- example: name -->`` in ``namespace``."""
    found = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert found, f"no example {name!r} in {GUIDE.name}"
    exec(found.group(1), namespace)
    return namespace


class Cumsum(torch.nn.Module):
    def forward(self, x):
        return x.cumsum(0)


def _kept(rule, ep) -> bool:
    Fp32RulesAnalysis([rule], ep)(ep.graph_module)
    (cumsum,) = ep.graph.find_nodes(op="call_function", target=torch.ops.aten.cumsum.default)
    return meta.fp32_rule(cumsum) is not None


def test_the_example_safety_rule_keeps_a_long_cumsum_fp32_and_a_short_one_not():
    # the reason the walk-through adds to fx16/decisions.py, here an existing one's stand-in
    stand_in = SimpleNamespace(LONG_CUMSUM=Reason.ILL_CONDITIONED)
    names = _example(
        "safety rule",
        dataclass=dataclass,
        Node=Node,
        RuleContext=RuleContext,
        Reason=stand_in,
        overloads=overloads,
    )
    rule = names["LongCumsumRule"]()
    assert _kept(rule, export(Cumsum(), torch.ones(8192)))
    assert not _kept(rule, export(Cumsum(), torch.ones(64)))
    bounded = {"x": {0: Dim("n", min=2, max=1000)}}
    assert not _kept(rule, export(Cumsum(), torch.ones(64), dynamic_shapes=bounded))
    unbounded = {"x": {0: Dim("n", min=2)}}
    assert _kept(rule, export(Cumsum(), torch.ones(64), dynamic_shapes=unbounded))


class LogOneMinus(torch.nn.Module):
    def forward(self, x):
        return torch.log(1 - x)


def test_the_example_stable_rewrite_makes_log_of_one_minus_x_exact_in_fp16():
    names = _example(
        "stable rewrite",
        Node=Node,
        Graph=Graph,
        Rewrite=Rewrite,
        Builder=Builder,
        calls=calls,
        is_scalar=is_scalar,
        only_user=only_user,
        aten=torch.ops.aten,
    )
    x = torch.tensor([1e-4, -3e-4, 5e-3, 0.5])  # in fp16's normal range
    ep = export(LogOneMinus(), x)
    assert StabilizePass(rules=[names["Log1mx"]()])(ep.graph_module).modified
    ep.graph_module.recompile()
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.log1p.default in targets and torch.ops.aten.log.default not in targets
    half = ep.module()(x.half())
    exact = torch.log1p(-x.half().double())  # of the input as fp16 holds it
    assert ((half.double() - exact).abs() <= exact.abs() * 2**-10).all()  # one rounding
