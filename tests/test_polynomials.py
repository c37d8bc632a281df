"""read_polynomial: elementwise arithmetic read as a polynomial in its leaves, checked
against the program's own values; a leaf is any other op or a value read elsewhere too."""

import math

import torch
from fuzz_profile import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from fx16.passes import StabilizePass
from fx16.passes.polynomials import read_polynomial
from helpers import export

# (name, arity, how the program computes it): the ops the reader follows
_STEPS = {
    "add": (2, lambda a, b: a + b),
    "sub": (2, lambda a, b: a - b),
    "mul": (2, lambda a, b: a * b),
    "scale": (1, lambda a: a * 0.375),
    "shift": (1, lambda a: a + 1.5),
    "halve": (1, lambda a: a / 2.0),
    "neg": (1, lambda a: -a),
    "square": (1, lambda a: torch.pow(a, 2)),
}


@st.composite
def _formulas(draw):
    """A random formula over two leaves: a list of (step, operand positions), each
    operand an earlier value (0 and 1 are the leaves ``x.sin()`` and ``x.cos()``)."""
    formula = []
    for position in range(2, 2 + draw(st.integers(1, 6))):
        name = draw(st.sampled_from(sorted(_STEPS)))
        arity = _STEPS[name][0]
        operands = [draw(st.integers(0, position - 1)) for _ in range(arity)]
        formula.append((name, operands))
    return formula


class _Formula(torch.nn.Module):
    def __init__(self, formula):
        super().__init__()
        self.formula = formula

    def forward(self, x):
        values = [x.sin(), x.cos()]
        for name, operands in self.formula:
            values.append(_STEPS[name][1](*(values[i] for i in operands)))
        return values[-1]


def _evaluate(polynomial, leaves_at: dict, like: torch.Tensor) -> torch.Tensor:
    total = torch.zeros_like(like)
    for monomial, coefficient in polynomial.terms.items():
        term = torch.full_like(like, coefficient)
        for position, power in monomial:
            term = term * leaves_at[polynomial.leaves[position].name] ** power
        total = total + term
    return total


@settings(max_examples=examples(40), deadline=None)
@given(formula=_formulas(), seed=st.integers(0, 2**16))
def test_property_the_polynomial_computes_what_the_program_computes(formula, seed):
    """Random formulas of the ops the reader follows, over two leaves (a sine and a
    cosine of the input, each read by every step that names it): wherever the reader
    gives a polynomial, it equals the program's result in fp64; where it gives none,
    a power or a term count passed a formula's size. The leaves it found are ops it
    does not follow or values other ops also read."""
    x = torch.randn(16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ep = export(_Formula(formula), x)
    (output,) = ep.graph_module.graph.output_node().args[0]
    found = read_polynomial(output)
    if found is None:
        return
    for leaf in found.leaves:
        followed = leaf.target in (
            torch.ops.aten.add.Tensor,
            torch.ops.aten.sub.Tensor,
            torch.ops.aten.mul.Tensor,
            torch.ops.aten.div.Tensor,
            torch.ops.aten.neg.default,
            torch.ops.aten.pow.Tensor_Scalar,
        )
        assert not followed or len(leaf.users) > 1, leaf.format_node()
    interpreter = torch.fx.Interpreter(ep.graph_module, garbage_collect_values=False)
    (result,) = interpreter.run(x)
    leaves_at = {leaf.name: interpreter.env[leaf] for leaf in found.leaves}
    assert torch.allclose(_evaluate(found, leaves_at, result), result, rtol=1e-9, atol=1e-9)
    assert output in found.interior


def test_the_gelu_inner_formula_reads_as_two_terms_in_any_order():
    """``k * (x + c * x**3)`` and ``k * x * (1 + c * x * x)``: the same two terms."""
    k, c = math.sqrt(2 / math.pi), 0.044715

    class Written(torch.nn.Module):
        def forward(self, x):
            x = x.sin()
            return k * (x + c * torch.pow(x, 3.0)), k * x * (1 + c * x * x)

    ep = export(Written(), torch.randn(4))
    for output in ep.graph_module.graph.output_node().args[0]:
        found = read_polynomial(output)
        (x,) = found.leaves
        assert x.target == torch.ops.aten.sin.default
        assert math.isclose(found.coefficient((x, 1)), k, rel_tol=1e-15)
        assert math.isclose(found.coefficient((x, 3)), k * c, rel_tol=1e-15)
        assert len(found.terms) == 2 and found.coefficient((x, 2)) == 0.0


def test_a_division_by_a_tensor_or_a_large_power_is_no_polynomial():
    class NotPolynomial(torch.nn.Module):
        def forward(self, x):
            y = x.sin()
            return y / (y + 1), torch.pow(y, 7.0), torch.pow(y, 0.5)

    ep = export(NotPolynomial(), torch.randn(4))
    assert [read_polynomial(o) for o in ep.graph_module.graph.output_node().args[0]] == [None] * 3


def test_a_long_chain_is_read_no_further_than_a_formula():
    """3,000 scale-and-shift steps (a polynomial of degree 1 all the way): the reader
    stops after a formula's worth of ops instead of walking (and recursing) back through
    all of them, so a rule that reads from every op stays linear in the graph."""

    class Chain(torch.nn.Module):
        def forward(self, x):
            for _ in range(1500):
                x = x * 1.001 + 0.1
            return x

    ep = export(Chain(), torch.randn(4))
    (output,) = ep.graph_module.graph.output_node().args[0]
    assert read_polynomial(output) is None
    assert StabilizePass()(ep.graph_module).modified is False  # no RecursionError either
