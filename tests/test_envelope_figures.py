"""The envelope's "larger inputs" figure over random programs: every figure the report
states is checked by running the cast program at it (0.9x: the outputs hold the float
oracle's bound; 1.1x: the value it names has left fp16's range)."""

import copy
import dataclasses

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from fx16 import meta
from fx16.program import Program
from fx16.report import report_of
from fx16.report.degrees import input_degrees
from fx16.report.growth_bounds import growth_bounds
from fx16.testing import programs
from fx16.testing.checks import check_outputs, quiet

FP16_LARGEST = float(torch.finfo(torch.float16).max)


def _scaled(case, factor: float) -> tuple:
    return tuple(a * factor if a.is_floating_point() else a for a in case.args)


class _Watch(torch.fx.Interpreter):
    """Runs a graph and keeps the value of the node named ``name``."""

    def __init__(self, module, name: str) -> None:
        super().__init__(module)
        self.name, self.value = name, None

    def run_node(self, node):
        value = super().run_node(node)
        if node.name == self.name:
            self.value = value
        return value


def _bounded_by_parts(ep, name: str) -> bool:
    """Whether the envelope judged the value ``name`` by a bound from its parts (it
    mixes degrees of growth: ``x - sigmoid(x)``), not by its calibrated maximum: a
    figure that holds, not one it reaches."""
    (node,) = [node for node in ep.graph.nodes if node.name == name]
    return node in growth_bounds(ep, input_degrees(ep))


def _named(ep, name: str) -> bool:
    return any(node.name == name for node in ep.graph.nodes)


def _size_growth(ep, name: str) -> float:
    """How much larger than calibration's the cast judged the value ``name``, for a
    dynamic size's bound (``fx16.meta.SIZE_GROWTH``; 1 where it did not)."""
    (node,) = [node for node in ep.graph.nodes if node.name == name]
    grown = node.meta.get(meta.SIZE_GROWTH)
    return grown[0] if grown else 1.0


def _largest(ep, args, name: str) -> float:
    """The largest magnitude the value ``name`` holds when ``ep`` runs on ``args`` (inf
    where it is not finite)."""
    inputs = Program.of(ep).graph_inputs(fx16.inputs_for(ep, args)[0], {})
    watch = _Watch(ep.graph_module, name)
    with torch.no_grad():
        watch.run(*inputs)
    value = watch.value.float()
    return float(value.abs().max()) if bool(torch.isfinite(value).all()) else float("inf")


def test_property_larger_inputs_hold_to_the_stated_factor_and_no_further():
    """Random programs from the fuzzer's menu, calibrated on inputs scaled so that scale
    domains form: where the envelope says float inputs up to N times the calibration
    inputs keep 16-bit values in range, the cast program at 0.9 N holds the float
    oracle's bound against the fp32 program. The figure's unit is a value that grows as
    the inputs to its degree: where the value it names as the tightest grows so (within
    1% from 1x to 1.1 N; ``x + 1`` does not) and was judged by its calibrated maximum
    (not by a bound from its parts, which holds but is not reached: ``x - sigmoid(x)``
    within 1% of x's growth), at 1.1 N that value has left fp16's range
    in the cast program (inf); where the figure was judged at a dynamic size's bound, at
    1.1 N times the value's growth to that bound (the inputs keep calibration's sizes).
    Both checks run in some of the examples (counted)."""
    checked, tight = [], []

    @settings(max_examples=examples(10), deadline=None)
    @given(programs(), st.sampled_from([1.0, 1e3, 3e4]))
    def check(case, input_scale):
        case = dataclasses.replace(case, args=_scaled(case, input_scale))
        with quiet():
            original = case.export()
            ep = fx16.cast_fp32_to_fp16(copy.deepcopy(original))
        found = report_of(ep).totals.envelope
        if found.headroom is None or not 1.5 < found.headroom < 1e6:
            return
        check_outputs(original, ep, _scaled(case, 0.9 * found.headroom))
        checked.append(True)
        name, factor = found.headroom_node, 1.1 * found.headroom
        # the watch runs the program's own graph: a value named inside a body (a
        # while_loop's, or a cast fx16 put there) is checked at 0.9x only
        at_one = _largest(original, case.args, name) if _named(original, name) else None
        unscaled = _largest(original, _scaled(case, factor), name) if at_one else None
        grows = (
            at_one
            and unscaled
            and abs(unscaled / (at_one * factor**found.headroom_degree) - 1) < 1e-2
        )
        if grows and _named(ep, name) and not _bounded_by_parts(ep, name):
            tight.append(True)
            # judged at a dynamic size's bound, the figure leaves room for the value's
            # growth with the size: at the calibration sizes it overflows that much later
            growth = _size_growth(ep, name) ** (1 / found.headroom_degree)
            beyond = _largest(ep, _scaled(case, factor * growth), name)
            assert beyond > FP16_LARGEST, (name, found.headroom, beyond)

    check()
    assert checked and tight, f"0.9x checked in {len(checked)}, 1.1x in {len(tight)}"
