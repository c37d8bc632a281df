"""A scaled RMSNorm's statistic and output in 16-bit as accurate as the fp32 ones, for a
norm the model computes in an fp32 region of its own (``RmsNormScaling`` inside a
retargeted region).

``.half()`` keeps the statistic in fp32 and rounds the norm's output once. A 16-bit
``rsqrt`` of a 16-bit mean rounds once per row for the whole row, and every element's
product rounds again: 1.3-1.5x that error on the norm's output, and on a model whose
rows hold a few massive activations (trained LLMs') about 1.17x on the logits. Any
error in the row's factor beyond about 2**-20 shows: a uniform 2**-16 costs 6%. Here,
for a row ``y`` already divided by its power of two (|y| < 128), every step is exact or
recovers its own rounding (``fx16.passes.stable_rewrites.exact_parts``):

- the mean of squares as a pair: the rounded mean ``c`` and the mean of the exact
  squares' halves less c, ``mean(cat(hi**2, 2 hi lo, lo**2, -c)) * 4`` for ``y = hi + lo``
  (Veltkamp): the reduction accumulates wider and rounds only its small result;
- eps enters as ``eps / s**2``, two 16-bit parts of the constant times a power of two,
  each product exact, the first added with its rounding recovered (Knuth);
- an integer j brings the statistic ``t`` into [0.5, 2) as ``4**j`` times it (exact);
  ``r = t**-0.5`` is a 16-bit rsqrt refined by one Newton step whose residual
  ``1 - t r0**2`` is computed exactly (Dekker's products), giving r as a pair
  ``r_hi + r_lo`` to about 2**-21;
- the output ``y * 2**j * r`` is the rounded product plus its exact error and the low
  part's product, summed before the last rounding: correctly rounded but within about
  2**-10 of a tie, as ``.half()``'s is. It is formed ``2**m`` larger (m from the row
  length, so that it stays below 2**13) where the error's parts are normal, then scaled
  back.

The output matches ``.half()``'s bit for bit on 99.9% of ordinary rows' elements and on
every normal element of massive rows but those within a hair of a tie (elements of a
massive row whose output is subnormal differ by a subnormal step). A sum of squares
(an L2 norm) over one dim takes its remainder likewise; over several it takes none, and
its statistic keeps the sum's one rounding.

The cost, per element: the split, three exact products and the remainder's
concatenation and mean, then the product with its error: about 25 elementwise ops more
than the model's form; per row, about 75 16-bit ops on one value each (a converted
Llama's Core AI program holds about 2x the ops). Every op is one ExecuTorch's portable
kernels run; no value is fp32.
"""

import math

import torch
from torch.fx import Node

from fx16.meta import NEGLIGIBLE, ROUNDING_CANCELS, SCALED
from fx16.passes.stable_rewrites.exact_parts import ExactParts
from fx16.passes.stable_rewrites.matching import Builder

aten = torch.ops.aten

# Why the scale's rounding does not matter: the result is the same for any s > 0.
ANY_SCALE = (
    "the scale s of a scaled RMSNorm: the result is the same for any s > 0, so its rounding "
    "(a power of two a step off) cancels"
)

# Why the eps term's products are exact, and why its parts may flush.
_POWERS_EXACT = (
    "a part of a scaled RMSNorm's eps term: a 16-bit part of eps / f**2 times powers of "
    "two (2**-k, 4**j), exact while normal"
)
_EPS_PARTS = (
    "the eps term of a scaled RMSNorm, eps / s**2 times 4**j, in parts: where a part is "
    "below 16-bit's normal range the statistic it is added to is at least 0.5, so "
    "flushing it changes that sum by under 2**-13 of one rounding"
)

# Why the statistic's pair is computed exactly (or its roundings recovered).
_STATISTIC = (
    "a scaled RMSNorm's mean of squares as a pair, the rounded mean and the exact squares' "
    "remainder: each split and product is exact, the remainder's reduction rounds only "
    "its result, below 2**-11 of the mean; a part that flushes is below 2**-24, against "
    "a mean of at least 4096 / row length (a sum: at least 1)"
)

# Why the row's factor is computed to twice the 16-bit precision.
_FACTOR = (
    "a scaled RMSNorm's factor t**-0.5 for t in [0.5, 2), a 16-bit rsqrt refined by a "
    "Newton step whose residual 1 - t * r0**2 is computed exactly: r as a pair to about "
    "2**-21"
)

# Why the output's parts are exact, and why the output stays in range.
_OUTPUT = (
    "a scaled RMSNorm's output y * 2**j * r, formed 2**m larger: the rounded product, its "
    "exact error (Dekker) and the low part's product, below 2**13 for a row of any values"
)


class EpsTerm:
    """``eps / s**2`` for s = 2**k * f: ``2**-k * (2**-k * c)`` for the constant c = eps /
    f**2 in two parts, hi its nearest 16-bit number and lo the rest (in 16-bit, its own
    nearest), each product a power of two times one number: exact while normal
    (``(sqrt(eps) / s)**2`` rounds twice); in fp64 the two parts are c to the last bit.
    ``inverse`` is 2**-k, ``pow(0.5, k)``: the exponent itself takes no arithmetic, so a
    scale domain through the norm shifts k and 2**-k as it shifts the row's largest
    magnitude."""

    def __init__(self, constant: float, inverse: Node) -> None:
        self.high = float(torch.tensor(constant, dtype=torch.float16))
        self.low = constant - self.high
        self.inverse = inverse

    def parts(self, make: Builder) -> list[Node]:
        """The term's parts (the high one first; the low one where the constant has one)."""
        made = []
        for part in (self.high, self.low):
            if part:
                once = make(aten.mul.Tensor, self.inverse, part)
                made.append(make(aten.mul.Tensor, once, self.inverse))
                for node in (once, made[-1]):
                    node.meta[ROUNDING_CANCELS] = _POWERS_EXACT
                    node.meta[NEGLIGIBLE] = _EPS_PARTS
        return made


def compensated(
    make: Builder, y: Node, power: Node, dims, eps: EpsTerm | None, summed: bool
) -> Node:
    """``y * (power + eps / s**2) ** -0.5`` as the module computes it in fp32, rounded
    once, for the mean (or sum: ``summed``) of squares ``power`` of the row ``y``."""
    exact = ExactParts(make, _STATISTIC)
    halves = exact.split(y)
    remainder = _remainder(exact, halves, y, power, dims, summed)
    low_parts = [] if remainder is None else [remainder]
    eps_parts = [] if eps is None else eps.parts(make)
    rough = power
    if eps_parts:  # the high part added, its rounding kept
        rough = exact(aten.add.Tensor, power, eps_parts[0])
        low_parts.append(exact.sum_error(power, eps_parts[0], rough))
        low_parts.extend(eps_parts[1:])
    # j = floor((1 - log2 t) / 2), so that t * 4**j lies in [0.5, 2)
    logarithm = make(aten.log2.default, rough)
    halved = make(aten.mul.Tensor, logarithm, -0.5)
    j = make(aten.div.Tensor_mode, make(aten.add.Tensor, halved, 0.5), 1.0, rounding_mode="floor")
    quartic = make(aten.pow.Scalar, 2.0, make(aten.mul.Tensor, j, 2.0))
    for node in (logarithm, halved, *j.all_input_nodes, j, *quartic.all_input_nodes, quartic):
        node.meta[ROUNDING_CANCELS] = ANY_SCALE
    low = low_parts[0] if low_parts else None
    for part in low_parts[1:]:
        low = exact(aten.add.Tensor, low, part)
    near_one = exact(aten.mul.Tensor, rough, quartic)
    statistic = (near_one, None if low is None else exact(aten.mul.Tensor, low, quartic))
    factor = _inverse_root(ExactParts(make, _FACTOR), statistic)
    return _product(ExactParts(make, _OUTPUT), y, halves, factor, j, _lift(y, dims))


def _remainder(exact: ExactParts, halves, y: Node, power: Node, dims, summed: bool):
    """``mean(y**2) - power`` (a sum: ``sum(y**2) - power``) from the exact squares' halves,
    reduced with the power taken away, so the reduction rounds only the small result:
    a mean over the halves and n copies of -power is a quarter of it; a sum over them and
    one -power is it. None for a sum over several dims (no one copy to place)."""
    high, low = halves
    if summed and len(dims) != 1:
        return None
    taken = exact(aten.neg.default, power)
    if not summed:
        taken = exact(aten.add.Tensor, exact(aten.mul.Tensor, y, 0.0), taken)
    pieces = [
        exact(aten.mul.Tensor, high, high),
        exact(aten.mul.Tensor, exact(aten.add.Tensor, high, high), low),
        exact(aten.mul.Tensor, low, low),
        taken,
    ]
    joined = exact(aten.cat.default, pieces, dims[0])
    if summed:
        return exact(aten.sum.dim_IntList, joined, list(dims), True)
    return exact(aten.mul.Tensor, exact(aten.mean.dim, joined, list(dims), True), 4.0)


def _inverse_root(exact: ExactParts, statistic: tuple[Node, Node | None]) -> tuple[Node, Node]:
    """``t**-0.5`` as a pair (high, low) for ``t = high + low`` in [0.5, 2): one Newton
    step from the 16-bit rsqrt, ``r0 * (1 - e / 2 + 3 e**2 / 8)`` for the exact excess
    ``e = t * r0**2 - 1`` (below 2**-9)."""
    high, low = statistic
    whole = high if low is None else exact(aten.add.Tensor, high, low)
    root = exact(aten.rsqrt.default, whole)
    root_halves = exact.split(root)
    square = exact(aten.mul.Tensor, root, root)
    square_low = exact.product_error(root_halves, root_halves, square)
    product = exact(aten.mul.Tensor, high, square)
    error = exact.product_error(exact.split(high), exact.split(square), product)
    excess = exact(aten.add.Tensor, exact(aten.sub.Tensor, product, 1.0), error)  # exact
    cross = exact(aten.mul.Tensor, high, square_low)
    if low is not None:
        cross = exact(aten.add.Tensor, cross, exact(aten.mul.Tensor, low, square))
    excess = exact(aten.add.Tensor, excess, cross)
    series = exact(aten.mul.Tensor, exact(aten.mul.Tensor, excess, excess), 0.375)
    series = exact(aten.add.Tensor, series, exact(aten.mul.Tensor, excess, -0.5))
    correction = exact(aten.mul.Tensor, root, series)
    refined = exact(aten.add.Tensor, root, correction)
    return refined, exact.sum_error(root, correction, refined)


def _product(
    exact: ExactParts, y: Node, halves, factor: tuple[Node, Node], j: Node, lift: int
) -> Node:
    """``y * 2**j * (high + low)``, rounded once: the product formed ``2**lift`` larger
    with its exact error, then scaled back."""
    high, low = factor
    scale = exact(aten.pow.Scalar, 2.0, exact(aten.add.Tensor, j, float(lift)))
    scaled_halves = [exact(aten.mul.Tensor, half, scale) for half in exact.split(high)]
    make = exact.make
    product = make(aten.mul.Tensor, y, exact(aten.mul.Tensor, high, scale))
    error = exact.product_error(halves, scaled_halves, product)
    tail = exact(aten.mul.Tensor, y, exact(aten.mul.Tensor, low, scale))
    whole = make(aten.add.Tensor, product, exact(aten.add.Tensor, error, tail))
    output = make(aten.mul.Tensor, whole, 2.0**-lift)
    for node in (product, whole, output):
        node.meta[SCALED] = _OUTPUT
    product.meta[ROUNDING_CANCELS] = _OUTPUT  # its error is added back
    return output


def _lift(y: Node, dims) -> int:
    """m for a row of n elements: the output, at most sqrt(n), times 2**m below 2**13
    (n taken as 2**16 where the row length is symbolic)."""
    shape = y.meta["val"].shape
    length = 1
    for dim in dims:
        size = shape[dim]
        length *= size if isinstance(size, int) else 2**16
    return 13 - math.ceil(math.log2(math.sqrt(max(length, 1))))
