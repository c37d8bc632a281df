"""only_product_operands: which values reach nothing but matrix products and convolutions.

Small exported programs (bodies too) and hand-built graphs check each way a value can be
read; a property over the fuzzer's programs checks the answer against readers added to
each state tensor: a product (or a view read by one) never changes it, and any other op
always makes it False. The last test measures why it matters: a product operand rounded
to nearest is never further from the fp64 result than one whose tiny elements are lifted.
"""

import operator

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings
from torch.fx import Graph, GraphModule

from fx16.analysis.facts import Facts
from fx16.analysis.product_operands import only_product_operands
from fx16.ops.numerics import FP16_TINY, tensor_to_fp16
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from fx16.testing import programs
from helpers import export

aten = torch.ops.aten


def _answers(ep) -> dict[str, bool]:
    """Each state tensor's name -> the analysis's answer for its placeholder."""
    boundaries = Facts.of(ep.graph_module).boundaries
    return {
        slot.target: only_product_operands(slot.placeholder, boundaries)
        for slot in Program(ep).state_slots()
    }


class Readers(torch.nn.Module):
    """One weight per way of being read."""

    def __init__(self):
        super().__init__()
        for name in ("linear", "viewed", "divisor", "scaled", "returned", "table"):
            self.register_parameter(name, torch.nn.Parameter(torch.randn(4, 4)))
        self.kernel = torch.nn.Parameter(torch.randn(2, 1, 3))
        self.register_buffer("widened", torch.randn(4, 4))

    def forward(self, x, ids):
        y = torch.nn.functional.linear(x, self.linear)
        y = y + x @ self.viewed.t().reshape(4, 4)[:, :4]
        y = y + (x.double() @ self.widened.double()).float()
        y = y + torch.nn.functional.conv1d(x[:, None], self.kernel).sum() * 0.0
        y = y / self.divisor.abs().sum()
        y = y * self.scaled
        return y + self.table[ids], self.returned


def test_each_way_of_reading_a_weight():
    """Products, read directly, through a view chain or a float cast (whose metadata
    export also checks), are product operands; a divisor, a factor of an elementwise
    multiply, a gathered table and an output are not."""
    ep = export(Readers(), torch.randn(4, 4), torch.tensor([0, 1, 3, 2]))
    assert _answers(ep) == {
        "linear": True,
        "viewed": True,
        "widened": True,
        "kernel": True,
        "divisor": False,
        "scaled": False,
        "returned": False,
        "table": False,
    }


class InBody(torch.nn.Module):
    """One weight a cond's branches multiply, one they divide by, one a branch returns
    and the program then takes the log of."""

    def __init__(self):
        super().__init__()
        self.product = torch.nn.Parameter(torch.randn(4, 4))
        self.divisor = torch.nn.Parameter(torch.randn(4, 4))
        self.passed = torch.nn.Parameter(torch.rand(4, 4) + 1)

    def forward(self, x):
        def taken(x, product, divisor, passed):
            return x @ product, x / divisor, passed.t().clone(memory_format=torch.contiguous_format)

        def other(x, product, divisor, passed):
            return x @ product.t(), x / divisor.t(), passed.clone()

        operands = (x, self.product, self.divisor, self.passed)
        y, z, returned = torch.cond(x.sum() > 0, taken, other, operands)
        return y + z + returned.log()


def test_the_answer_follows_a_weight_into_and_out_of_bodies():
    ep = export(InBody(), torch.randn(4, 4))
    assert len(Facts.of(ep.graph_module).graph_modules) == 3
    assert _answers(ep) == {"product": True, "divisor": False, "passed": False}


class InRegions(torch.nn.Module):
    """A weight a matmul reads inside a disabled autocast region, and one divided by
    inside a no-grad region."""

    def __init__(self):
        super().__init__()
        self.product = torch.nn.Parameter(torch.randn(4, 4))
        self.divisor = torch.nn.Parameter(torch.rand(4, 4) + 1)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            y = x @ self.product
        with torch.no_grad():
            z = x / self.divisor
        return y + z


def test_the_answer_follows_a_weight_into_autocast_and_grad_regions():
    ep = torch.export.export(InRegions(), (torch.randn(4, 4),))
    bodies = Facts.of(ep.graph_module).graph_modules[1:]
    assert len(bodies) == 2
    assert _answers(ep) == {"product": True, "divisor": False}


def _graph_reading(build) -> tuple[GraphModule, torch.fx.Node]:
    """A hand-built graph: a placeholder ``w``, the readers ``build(graph, w)`` adds, and
    an output of the first input ``x``."""
    graph = Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    build(graph, w)
    graph.output(x)
    return GraphModule(torch.nn.Module(), graph), w


def _answer(build) -> bool:
    module, w = _graph_reading(build)
    return only_product_operands(w, Boundaries(module))


def test_a_write_in_place_a_split_and_unread_values():
    """``copy_`` stores the weight into another tensor (not a move); a split's pieces
    read through ``getitem`` by products are product operands; a value nothing reads is too."""
    assert _answer(lambda g, w: None)

    def written(g, w):
        g.call_function(aten.copy_.default, (g.placeholder("buffer"), w))

    assert not _answer(written)

    def split(g, w):
        pieces = g.call_function(aten.split.Tensor, (w, 2))
        for index in range(2):
            piece = g.call_function(operator.getitem, (pieces, index))
            g.call_function(aten.mm.default, (piece, piece))

    assert _answer(split)


@pytest.mark.parametrize("dtype, expected", [(torch.float64, True), (torch.bool, False)])
def test_a_cast_moves_values_only_to_a_float_dtype(dtype, expected):
    """A cast to bool tests each element against zero; a cast to fp64 keeps its value."""

    def cast(g, w):
        converted = g.call_function(aten._to_copy.default, (w,), {"dtype": dtype})
        converted.meta["val"] = torch.empty(2, 2, dtype=dtype)
        g.call_function(aten.mm.default, (converted, converted))

    assert _answer(cast) is expected


def _add_reader(placeholder, target, through_view: bool) -> list:
    """Add ``target(value, value)`` (or ``target(value)``) reading ``placeholder``, or a view
    of it, in the placeholder's own graph; the nodes added, last first."""
    graph = placeholder.graph
    with graph.inserting_after(placeholder):
        value = placeholder
        if through_view:
            value = graph.call_function(aten.view.default, (placeholder, [-1]))
    with graph.inserting_after(value):
        arity = 2 if target is aten.mm.default else 1
        reader = graph.call_function(target, (value,) * arity)
    return [reader] + ([value] if through_view else [])


@settings(max_examples=examples(10), deadline=None)
@given(programs())
def test_property_a_product_reader_changes_nothing_and_any_other_reader_ends_it(case):
    """On the fuzzer's programs, every graph's placeholders (a body's too, where a weight
    lands): a new product reader keeps each answer, a new reciprocal makes it False,
    directly or through a view."""
    ep = case.export()
    for module in Facts.of(ep.graph_module).graph_modules:
        for placeholder in list(module.graph.find_nodes(op="placeholder")):
            before = only_product_operands(placeholder, Boundaries(ep.graph_module))
            for through_view in (False, True):
                for target, expected in (
                    (aten.mm.default, before),
                    (aten.reciprocal.default, False),
                ):
                    added = _add_reader(placeholder, target, through_view)
                    answer = only_product_operands(placeholder, Boundaries(ep.graph_module))
                    for node in added:
                        module.graph.erase_node(node)
                    assert answer is expected, (placeholder.name, target, through_view)


def test_a_product_operand_rounded_to_nearest_is_never_further_from_fp64_than_lifted():
    """The reason for the rule: with elements below half the smallest subnormal (which
    round to zero), a weight rounded to nearest changes no element more than lifting
    them to +-2**-24 does, so every output's error bound is smaller, on every input (wide,
    near-silent rows, a narrow column beside wide ones); and the error those elements add
    to the products is smaller too."""
    torch.manual_seed(0)
    weight = torch.randn(64, 64).double() * 0.02
    tiny = torch.zeros_like(weight, dtype=torch.bool)
    tiny[::3, ::5] = True
    weight[tiny] = torch.randn(int(tiny.sum())).double() * 1e-8  # below 2**-25
    nearest, lifted = weight.float().half().double(), tensor_to_fp16(weight.float()).double()
    assert torch.all(lifted[tiny].abs() == FP16_TINY) and torch.all(nearest[tiny] == 0)
    assert torch.equal(nearest[~tiny], lifted[~tiny])
    change_nearest, change_lifted = (nearest - weight).abs(), (lifted - weight).abs()
    assert torch.all(change_nearest <= change_lifted)
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 64, generator=generator).double() * 10.0 ** (seed % 5)
        x[::4] *= 1e-6  # near-silent rows
        x[:, 7] *= 1e-4  # a narrow column beside the wide ones
        # each output's error bound: the sum over j of |change of w_j| * |x_j|
        assert torch.all(x.abs() @ change_nearest <= x.abs() @ change_lifted)
        added_nearest = (x @ ((nearest - weight) * tiny)).abs().sum()
        added_lifted = (x @ ((lifted - weight) * tiny)).abs().sum()
        assert added_nearest < added_lifted
