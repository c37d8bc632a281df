"""A scaled RMSNorm's statistic in 16-bit as accurate as the fp32 one, for a norm the model
computes in an fp32 region of its own (``RmsNormScaling`` inside a retargeted region).

A 16-bit ``rsqrt`` of a 16-bit mean rounds once per row for the whole row: on the norm's
output 1.3-1.5x the error of ``.half()``'s fp32 statistic, which rounds only the product.
Here, for a row ``y`` already divided by its power of two (|y| < 128):

- the mean's own rounding is recovered from the mean of the residuals ``y**2 - c``, for
  c the mean's leading 4 bits: each residual is exact where it is large (a few "massive"
  elements that dominate the row), and where it rounds the roundings average out;
- eps enters as ``eps / s**2``, two 16-bit parts of the constant times a power of two,
  each product exact;
- an integer j brings the statistic near 1: ``t = (c + residuals' mean + eps / s**2) *
  4**j`` in [0.5, 2), and ``c * 4**j - 1`` is exact;
- the result is ``y' - y' * h`` for ``y' = y * 2**j`` (exact) and ``h = 1 - t**-0.5 =
  (t - 1) / (t + sqrt(t))``, below 0.3: only h and its product round, as a fraction h of
  the one rounding the fp32 form has.

About 1.04-1.08x the fp32 statistic's error on the norm's output, on every CPU kernel path
(a sum of squares takes no residual; the form's floor, with h exact to 22 bits, is about
1.045x). Where a few massive elements dominate a row (trained LLMs' massive activations),
their squares round in 16-bit and h's rounding is not averaged: 1.1-1.2x on such rows
(exact squares would take six elementwise ops more per norm).

The cost: per element, the residual and its mean, two products and a subtraction more; per
row, a handful of 16-bit ops. Every op is one ExecuTorch's portable kernels run; the
per-row chain to 2**j runs outside the XNNPACK delegate, a delegate call more per norm.
"""

import torch
from torch.fx import Node

from fx16.meta import NEGLIGIBLE, ROUNDING_CANCELS, SCALED
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

# Why the residual mean may round or flush: it corrects the mean's leading bits.
_RESIDUAL = (
    "the residuals y**2 - c of a scaled RMSNorm, c the mean of squares' leading 4 bits, and "
    "their mean: exact where a residual is large, each rounding averaged over the row "
    "where it is not; a mean of them that flushes is below 2**-14, against a mean of "
    "squares of at least 4096 / row length"
)

# Why the statistic near one is computed to full accuracy.
_NEAR_ONE = (
    "a scaled RMSNorm's statistic t = mean * 4**j in [0.5, 2), t - 1 (exact: Sterbenz) "
    "and h = (t - 1) / (t + sqrt(t)) below 0.3: h's rounding reaches the "
    "output as a fraction h of one rounding, and a flushed h or y' * h is below 2**-14 "
    "of the row's values, which round by more"
)

# Why the row times 2**j stays in range: the row over its root mean square.
_UNIT_ROW = "a scaled RMSNorm's y * 2**j: within 2x of y / rms(y), below sqrt(row length) * 2"


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

    def parts(self, make: Builder, quartic: Node | None) -> list[Node]:
        """The term's parts times 4**j (``quartic``; None: the high part alone, times 1,
        enough to choose j)."""
        made, finals = [], []
        for part in [self.high] if quartic is None else [self.high, self.low]:
            if part:
                once = make(aten.mul.Tensor, self.inverse, part)
                finals.append(make(aten.mul.Tensor, once, self.inverse))
                made += [once, finals[-1]]
                if quartic is not None:
                    finals[-1] = make(aten.mul.Tensor, finals[-1], quartic)
                    made.append(finals[-1])
        for node in made:
            node.meta[ROUNDING_CANCELS] = _POWERS_EXACT
            node.meta[NEGLIGIBLE] = _EPS_PARTS
        return finals


def compensated(
    make: Builder, y: Node, power: Node, squares: Node | None, dims, eps: EpsTerm | None
) -> Node:
    """``y * (power + eps / s**2) ** -0.5`` as the module computes it, for the mean (or
    sum: ``squares`` None, no residual) of squares ``power`` of the row ``y``."""
    rough = power
    if eps is not None:
        rough = make(aten.add.Tensor, power, *eps.parts(make, None))
        rough.meta[ROUNDING_CANCELS] = ANY_SCALE
    # j = floor((1 - log2 t) / 2), so that t * 4**j lies in [0.5, 2)
    logarithm = make(aten.log2.default, rough)
    halved = make(aten.mul.Tensor, logarithm, -0.5)
    shifted = make(aten.add.Tensor, halved, 0.5)
    j = make(aten.div.Tensor_mode, shifted, 1.0, rounding_mode="floor")
    doubled_j = make(aten.mul.Tensor, j, 2.0)
    unit = make(aten.pow.Scalar, 2.0, j)
    quartic = make(aten.pow.Scalar, 2.0, doubled_j)
    near_one = make(aten.mul.Tensor, power, quartic)
    # its leading 4 bits (Veltkamp's split): a centre the residuals subtract exactly
    spread = make(aten.mul.Tensor, near_one, 129.0)
    leftover = make(aten.sub.Tensor, spread, near_one)
    coarse = make(aten.sub.Tensor, spread, leftover)
    chain = (logarithm, halved, shifted, j, doubled_j, unit, quartic, spread, leftover)
    for node in (*chain, coarse):
        node.meta[ROUNDING_CANCELS] = ANY_SCALE
    if squares is not None:
        centre = make(aten.div.Tensor, coarse, quartic)
        residuals = make(aten.sub.Tensor, squares, centre)
        residual = make(aten.mean.dim, residuals, dims, True)
        rest = [make(aten.mul.Tensor, residual, quartic)]
        for node in (centre, residuals, residual):
            node.meta[ROUNDING_CANCELS] = _RESIDUAL
        residual.meta[NEGLIGIBLE] = _RESIDUAL
    else:
        rest = [make(aten.sub.Tensor, near_one, coarse)]  # exact: the split's other part
    deviation = make(aten.sub.Tensor, coarse, 1.0)  # exact: 4 bits near 1
    if eps is not None:
        rest.extend(eps.parts(make, quartic))
    sums = [deviation]
    for part in rest:
        deviation = make(aten.add.Tensor, deviation, part)
        sums.append(deviation)
    statistic = make(aten.add.Tensor, deviation, 1.0)
    denominator = make(aten.add.Tensor, statistic, make(aten.sqrt.default, statistic))
    shortfall = make(aten.div.Tensor, deviation, denominator)  # 1 - t**-0.5
    unit_row = make(aten.mul.Tensor, y, unit)
    correction = make(aten.mul.Tensor, unit_row, shortfall)
    for node in (near_one, *rest, *sums, shortfall, correction):
        node.meta[ROUNDING_CANCELS] = _NEAR_ONE
        node.meta[NEGLIGIBLE] = _NEAR_ONE
    unit_row.meta[SCALED] = _UNIT_ROW
    return make(aten.sub.Tensor, unit_row, correction)
