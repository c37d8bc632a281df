"""How each op treats values carried at a power-of-two scale 2**e (scale domains).

A value ``v`` carried at exponent ``e`` holds ``v * 2**e``. An op's rule says what its
result's exponent is given its operands', and what must hold for the op to compute
the same function: operands that must share an exponent, scalars that scale with
them, operands that must be unscaled. ``fx16.analysis.scale_exponents`` reads it.

Kinds:

- ``SAME``: ``f(s x, s y) = s f(x, y)`` for the tensors at ``tensors`` with the
  numbers at ``scalars`` scaled alike (add, views, cat, relu, pooling, sum, mean,
  clamp with its bounds, where with its scalar, embedding's table).
- ``PRODUCT``: degree one in each of ``tensors`` (mul, mm, linear, conv); ``divides``:
  the second operand divides (div). ``bias``: an operand added to the product, which
  must share the product's exponent.
- ``POWER``: ``f(s x) = s**n f(x)`` (pow by a scalar, sqrt, rsqrt, reciprocal).
- ``NORM``: the result is the weight's exponent whatever the input's, with eps scaled
  with the input (LayerNorm, GroupNorm, RMSNorm). A BatchNorm in eval reads running
  statistics: its weight takes the input's scale back and its mean is scaled alike,
  its variance and eps left as they are (or, where the weight cannot fold, scaled).
- ``SCALE_FREE``: a result that does not depend on a positive scale (comparisons
  against a scalar scaled alike, sign, argmax).
- ``ATTENTION``: scaled dot-product attention: its result scales as its values; the
  queries, keys and mask must be unscaled.
- ``RECURRENT``: an RNN over a sequence (lstm, gru, rnn_tanh, rnn_relu): its gates read
  the input only through the first layer's input weights (one per direction, in the
  weight list at ``params``), which take the input's scale back, folded; its states
  must be unscaled, and its results are unscaled.
- ``FILL``: a tensor filled with the numbers at ``scalars`` (zeros: none), made at
  whatever exponent its readers need; ``CREATION``: any other new tensor (arange,
  ones, rand): it reads its operands' shapes only, and is unscaled.
- ``LOG2`` / ``FLOOR`` / ``POWER_OF_BASE``: the chain ``2**floor(log2(m))`` that a
  stabilized norm computes its own scale with: a scale on ``m`` adds ``e`` to the
  logarithm and comes back out of the power.

Any other op (exp, softmax, gelu, a body of a higher-order op) reads its operands
unscaled and gives an unscaled result.
"""

import enum
from dataclasses import dataclass
from fractions import Fraction

import torch

from fx16.ops.declarations import declaration
from fx16.ops.tables import CREATION_OPS, VALUE_PRESERVING_OPS, is_cast_op, overloads, per_op


class Kind(enum.Enum):
    SAME = "same"
    PRODUCT = "product"
    POWER = "power"
    NORM = "norm"
    SCALE_FREE = "scale_free"
    ATTENTION = "attention"
    RECURRENT = "recurrent"
    LOG2 = "log2"
    FLOOR = "floor"
    POWER_OF_BASE = "power_of_base"
    FILL = "fill"
    CREATION = "creation"
    OPAQUE = "opaque"


@dataclass(frozen=True)
class ScaleRule:
    """One op's rule (see the module docstring); positions index ``node.args``."""

    kind: Kind
    tensors: tuple[int, ...] = ()
    scalars: tuple[int, ...] = ()  # numbers scaled with the tensors (SAME, SCALE_FREE)
    bias: int | None = None  # PRODUCT: an operand added to the product
    divides: bool = False  # PRODUCT: the second operand is a divisor
    power: Fraction | None = None  # POWER: the fixed exponent (None: read args[1])
    weight: int | None = None  # NORM: the weight and bias positions
    norm_bias: int | None = None
    eps: int | None = None  # NORM: where eps is, scaled by s**2
    mean: int | None = None  # NORM (BatchNorm): running mean (s) and variance (s**2)
    variance: int | None = None
    training: int | None = None  # NORM (BatchNorm): a training flag, which must be False
    # RECURRENT: the weight list, the number of layers and the bidirectional flag
    params: int | None = None
    layers: int | None = None
    bidirectional: int | None = None


OPAQUE = ScaleRule(Kind.OPAQUE)


def _rules(names: tuple[str, ...], rule: ScaleRule) -> dict:
    return dict.fromkeys(overloads(*names), rule)


def _same(*tensors: int, scalars: tuple[int, ...] = ()) -> ScaleRule:
    return ScaleRule(Kind.SAME, tensors, scalars)


def _product(a: int, b: int, bias: int | None = None, divides: bool = False) -> ScaleRule:
    return ScaleRule(Kind.PRODUCT, (a, b), bias=bias, divides=divides)


def _power(power: Fraction | None) -> ScaleRule:
    return ScaleRule(Kind.POWER, (0,), power=power)


_WRITES_IN_PLACE = overloads("copy_.default")

_FILLS = {
    **_rules(("full.default", "full_like.default"), ScaleRule(Kind.FILL, scalars=(1,))),
    **_rules(("new_full.default",), ScaleRule(Kind.FILL, scalars=(2,))),
    **_rules(("scalar_tensor.default",), ScaleRule(Kind.FILL, scalars=(0,))),
    **_rules(
        (
            "zeros.default",
            "zeros_like.default",
            "new_zeros.default",
            "empty.memory_format",
            "empty_like.default",
            "new_empty.default",
        ),
        ScaleRule(Kind.FILL),
    ),
}

RULES: dict = {
    **dict.fromkeys(CREATION_OPS, ScaleRule(Kind.CREATION)),
    **_FILLS,
    **{
        op: _same(*positions)
        for op, positions in VALUE_PRESERVING_OPS.items()
        if op not in _WRITES_IN_PLACE
    },
    **_rules(("add.Tensor", "sub.Tensor", "rsub.Tensor"), _same(0, 1, scalars=(1,))),
    **_rules(("add.Scalar", "sub.Scalar", "rsub.Scalar"), _same(0, scalars=(1,))),
    **_rules(
        (
            "neg.default",
            "relu.default",
            "abs.default",
            "leaky_relu.default",
            "dropout.default",
            "sum.dim_IntList",
            "sum.default",
            "mean.dim",
            "mean.default",
            "cumsum.default",
            "max_pool1d.default",
            "max_pool2d.default",
            "max_pool3d.default",
            "max_pool2d_with_indices.default",
            "avg_pool1d.default",
            "avg_pool2d.default",
            "avg_pool3d.default",
            "adaptive_avg_pool1d.default",
            "adaptive_avg_pool2d.default",
            "adaptive_max_pool2d.default",
            "max.dim",
            "min.dim",
            "topk.default",
            "sort.default",
            "embedding.default",
            "tril.default",
            "triu.default",
            "upsample_nearest2d.vec",
            "upsample_bilinear2d.vec",
            "pixel_shuffle.default",
            "_to_copy.default",
            "to.dtype",
            "to.dtype_layout",
        ),
        _same(0),
    ),
    **_rules(("hardtanh.default", "clamp.default"), _same(0, scalars=(1, 2))),
    **_rules(("clamp_min.default", "clamp_max.default"), _same(0, scalars=(1,))),
    **_rules(("maximum.default", "minimum.default"), _same(0, 1)),
    **_rules(("where.ScalarOther",), _same(1, scalars=(2,))),
    **_rules(("where.ScalarSelf",), _same(2, scalars=(1,))),
    **_rules(("masked_fill.Scalar",), _same(0, scalars=(2,))),
    **_rules(("constant_pad_nd.default",), _same(0, scalars=(2,))),
    **_rules(("pad.default",), _same(0, scalars=(3,))),
    **_rules(("mul.Tensor",), _product(0, 1)),
    **_rules(("div.Tensor",), _product(0, 1, divides=True)),
    **_rules(("mm.default", "bmm.default", "matmul.default", "mv.default"), _product(0, 1)),
    **_rules(
        (
            "linear.default",
            "conv1d.default",
            "conv2d.default",
            "conv3d.default",
            "convolution.default",
            "conv_transpose1d.default",
            "conv_transpose2d.input",
            "conv_transpose3d.input",
        ),
        _product(0, 1, bias=2),
    ),
    **_rules(("addmm.default", "baddbmm.default", "addmv.default"), _product(1, 2, bias=0)),
    **_rules(("mul.Scalar", "div.Scalar"), _same(0)),
    **_rules(("pow.Tensor_Scalar",), _power(None)),
    **_rules(("square.default",), _power(Fraction(2))),
    **_rules(("sqrt.default",), _power(Fraction(1, 2))),
    **_rules(("rsqrt.default",), _power(Fraction(-1, 2))),
    **_rules(("reciprocal.default",), _power(Fraction(-1))),
    **_rules(
        ("layer_norm.default", "native_layer_norm.default", "group_norm.default"),
        ScaleRule(Kind.NORM, (0,), weight=2, norm_bias=3, eps=4),
    ),
    **_rules(
        ("native_group_norm.default",),
        ScaleRule(Kind.NORM, (0,), weight=1, norm_bias=2, eps=7),
    ),
    **_rules(
        ("rms_norm.default",),
        ScaleRule(Kind.NORM, (0,), weight=2, eps=3),
    ),
    **_rules(
        ("batch_norm.default",),
        ScaleRule(Kind.NORM, (0,), weight=1, norm_bias=2, mean=3, variance=4, training=5, eps=7),
    ),
    **_rules(
        ("_native_batch_norm_legit_no_training.default",),
        ScaleRule(Kind.NORM, (0,), weight=1, norm_bias=2, mean=3, variance=4, eps=6),
    ),
    **_rules(
        ("gt.Scalar", "lt.Scalar", "ge.Scalar", "le.Scalar", "eq.Scalar", "ne.Scalar"),
        ScaleRule(Kind.SCALE_FREE, (0,), scalars=(1,)),
    ),
    **_rules(
        ("gt.Tensor", "lt.Tensor", "ge.Tensor", "le.Tensor", "eq.Tensor", "ne.Tensor"),
        ScaleRule(Kind.SCALE_FREE, (0, 1), scalars=(1,)),
    ),
    **_rules(
        ("sign.default", "argmax.default", "argmin.default", "isnan.default", "isinf.default"),
        ScaleRule(Kind.SCALE_FREE, (0,)),
    ),
    **_rules(("scaled_dot_product_attention.default",), ScaleRule(Kind.ATTENTION, (0, 1, 2))),
    **_rules(
        ("lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input"),
        ScaleRule(Kind.RECURRENT, (0,), params=2, layers=4, bidirectional=7),
    ),
    **_rules(("log2.default",), ScaleRule(Kind.LOG2, (0,))),
    **_rules(("floor.default", "div.Tensor_mode"), ScaleRule(Kind.FLOOR, (0,))),
    **_rules(("pow.Scalar",), ScaleRule(Kind.POWER_OF_BASE, (1,))),
}


def scale_rule(target) -> ScaleRule:
    """The rule of the op ``target`` (``OPAQUE`` for any op without one): the table's,
    or for an op declared linear in some arguments (``fx16.declare_op``: a dequantize's
    scale; asked each time, for a declaration may come after a first cast), ``SAME``
    in those."""
    return _table_rule(target) or _declared_rule(target) or OPAQUE


@per_op
def _table_rule(target) -> ScaleRule | None:
    return RULES.get(target)


def _declared_rule(target) -> ScaleRule | None:
    declared = declaration(target)
    if declared is None or not declared.linear_in:
        return None
    names = [argument.name for argument in target._schema.arguments]
    positions = tuple(names.index(name) for name in declared.linear_in if name in names)
    return _same(*positions, scalars=positions) if positions else None


_WIDE = (torch.float32, torch.float64)


def rule_of(node) -> ScaleRule:
    """The rule of the call ``node``: its op's, except that a cast to a 16-bit dtype
    (the model's own ``x.half()``) is opaque, for it overflows and flushes at fixed
    magnitudes; a cast to fp32 or fp64 is exact at any scale."""
    rule = scale_rule(node.target)
    if is_cast_op(node.target):
        val = node.meta.get("val")
        if getattr(val, "dtype", None) not in _WIDE:
            return OPAQUE
    return rule
