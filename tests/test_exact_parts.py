"""fx16.passes.stable_rewrites.exact_parts: the error-free transformations the retargeted
RMSNorm is built from, each checked on its own in fp16 against exact (fp64) arithmetic:
Veltkamp's split, Dekker's product error and Knuth's sum error."""

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx import Graph, GraphModule

from fx16.meta import NEGLIGIBLE, ROUNDING_CANCELS
from fx16.passes.stable_rewrites.exact_parts import ExactParts
from fx16.passes.stable_rewrites.matching import Builder

aten = torch.ops.aten
WHY = "checked by test_exact_parts"


def _run(build, *values: torch.Tensor) -> list[torch.Tensor]:
    """Build a graph of fp16 placeholders with ``build(exact, *placeholders)`` (returning
    nodes) and run it on ``values``."""
    graph = Graph()
    placeholders = [graph.placeholder(f"v{i}") for i in range(len(values))]
    for placeholder, value in zip(placeholders, values):
        placeholder.meta["val"] = value
    output = graph.output(())
    exact = ExactParts(Builder(graph, output), WHY)
    results = build(exact, *placeholders)
    output.args = (tuple(results),)
    for node in graph.nodes:
        if node.op == "call_function":
            assert node.meta[ROUNDING_CANCELS] == WHY and node.meta[NEGLIGIBLE] == WHY
    return list(GraphModule(torch.nn.Module(), graph)(*values))


def _halves(magnitude: float):
    """fp16 values of either sign with magnitudes in [magnitude / 64, magnitude): their
    splits, products and sums stay in the normal range."""
    return st.lists(
        st.floats(magnitude / 64, magnitude, exclude_max=True, width=16),
        min_size=1,
        max_size=16,
    ).flatmap(
        lambda values: st.lists(st.booleans(), min_size=len(values), max_size=len(values)).map(
            lambda signs: [v if s else -v for v, s in zip(values, signs)]
        )
    )


def _fp16(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float16)


@settings(max_examples=examples(100), deadline=None)
@given(_halves(128.0))
def test_property_a_split_is_exact_and_its_halves_multiply_exactly(values):
    """hi + lo is the value, and hi * hi, hi * lo, lo * lo are exact in fp16 (below its
    maximum: the norm splits rows below 128): each half holds at most 5 significant
    bits."""
    x = _fp16(values)
    high, low = _run(lambda exact, v: exact.split(v), x)
    assert high.dtype == low.dtype == torch.float16
    assert torch.equal(high.double() + low.double(), x.double())
    for a, b in ((high, high), (high, low), (low, low)):
        assert torch.equal((a * b).double(), a.double() * b.double())


@settings(max_examples=examples(100), deadline=None)
@given(_halves(64.0), st.data())
def test_property_a_products_error_is_exact(a_values, data):
    """p = fl(a * b) and e = product_error: p + e is a * b exactly."""
    b_values = data.draw(_halves(64.0).filter(lambda b: len(b) >= len(a_values)))
    a, b = _fp16(a_values), _fp16(b_values[: len(a_values)])

    def build(exact, left, right):
        product = exact(aten.mul.Tensor, left, right)
        return [product, exact.product_error(exact.split(left), exact.split(right), product)]

    product, error = _run(build, a, b)
    assert torch.equal(product.double() + error.double(), a.double() * b.double())
    assert bool((error.double().abs() <= product.double().abs() * 2.0**-11).all())


@settings(max_examples=examples(100), deadline=None)
@given(_halves(1024.0), st.data())
def test_property_a_sums_error_is_exact(a_values, data):
    """s = fl(a + b) and e = sum_error: s + e is a + b exactly, whatever the order of the
    magnitudes (Knuth's form needs no comparison)."""
    b_values = data.draw(_halves(16.0).filter(lambda b: len(b) >= len(a_values)))
    a, b = _fp16(a_values), _fp16(b_values[: len(a_values)])

    def build(exact, left, right):
        total = exact(aten.add.Tensor, left, right)
        return [total, exact.sum_error(right, left, total)]

    total, error = _run(build, a, b)
    assert torch.equal(total.double() + error.double(), a.double() + b.double())
