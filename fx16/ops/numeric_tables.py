"""The op tables the numeric analyses read: which ops are singular at zero, which keep a
value's small end, which guard it (``fx16.analysis.underflow``), and which amplify their
input's rounding (``fx16.analysis.conditioning``)."""

import math

import torch

from fx16.ops.tables import overloads

aten = torch.ops.aten

# ---- underflow (fx16.analysis.underflow) -----------------------------------------------------

# Ops singular at zero, by the position of the argument that must not be zero (or tiny):
# a log's argument, a divisor, what a reciprocal, an inverse square root or a negative
# power reads. A value that is nonzero in fp32 but flushes to zero in 16-bit turns their
# result into an infinity, and 0 * inf into nan.
SINGULAR_AT_ZERO = {
    **dict.fromkeys(
        overloads(
            "log.default",
            "log2.default",
            "log10.default",
            "reciprocal.default",
            "rsqrt.default",
            "pow.Tensor_Scalar",
        ),
        0,
    ),
    **dict.fromkeys(overloads("div.Tensor", "div.Tensor_mode"), 1),
}
# Of those, the powers: singular at zero only for a negative exponent.
POWER_OPS = overloads("pow.Tensor_Scalar")
# Values that are an exponential of their input, whose small end is its tail e^z: the
# input M times wider takes their smallest value s to about s ** M.
EXPONENTIAL_TAIL_OPS = overloads("exp.default", "exp2.default", "sigmoid.default")
# Normalized exponentials: the input M times wider takes the smallest probability s to
# about (s / l) ** M * l, l the largest (the ratio of two is e^(z_i - z_j)).
SOFTMAX_OPS = overloads("softmax.int", "_softmax.default", "_safe_softmax.default")
# Reductions whose result is a norm's statistic when they read squares (a mean or sum of
# x ** 2), and the ops that are one on their own: zero on a silent input.
SUMMING_OPS = overloads("mean.dim", "mean.default", "sum.dim_IntList", "sum.default")
VARIANCE_OPS = overloads(
    "var.default", "var.dim", "var.correction", "std.default", "std.dim", "std.correction"
)
SQUARE_STATISTIC_OPS = VARIANCE_OPS | overloads(
    "linalg_vector_norm.default", "norm.Scalar", "norm.ScalarOpt_dim"
)
# Ops a value keeps its small end through on the way to a singular op: moves, casts, sqrt.
SMALL_END_PRESERVING_OPS = overloads(
    "sqrt.default",
    "_to_copy.default",
    "to.dtype",
    "clone.default",
    "view.default",
    "reshape.default",
    "unsqueeze.default",
    "squeeze.dim",
    "expand.default",
    "expand_as.default",
)
# Ops that raise a value to at least a scalar (an eps guard): add, clamp_min, clamp.
GUARD_OPS = overloads("add.Tensor", "clamp_min.default", "clamp.default")


def _guard_arguments() -> dict:
    found = {}
    for names, where in (
        (("add.Tensor", "add.Scalar"), (1, "other", 1.0)),
        (("sub.Tensor", "sub.Scalar"), (1, "other", -1.0)),
        (("clamp.default", "clamp_min.default"), (1, "min", 1.0)),
    ):
        for op in overloads(*names):
            found[op] = where
    return found


# Where a guarding op's scalar keeps its result away from zero: (position, name, the sign
# that makes it a guard). The addend of an add (a sub subtracts it: a negative one guards)
# and the minimum of a clamp; a clamp's maximum, an alpha or a negative minimum guard nothing.
GUARD_ARGUMENTS = _guard_arguments()
# Ops whose scalar is added or clamped to (a guard, when tiny): a scalar below the 16-bit
# subnormals is clamped to them there, where elsewhere (a multiplier) it is left as it is.
GUARDING_OPS = frozenset(GUARD_ARGUMENTS)

# ---- conditioning (fx16.analysis.conditioning) -------------------------------------------

# Ops whose condition number the conditioning rule knows: periodic ones, exp (op ->
# the factor in e^(factor x)), logarithms, powers, and tensor sums that can cancel.
PERIODIC_OPS = overloads("sin.default", "cos.default", "tan.default")
EXPONENTIAL_OPS = {
    **dict.fromkeys(overloads("exp.default", "expm1.default"), 1.0),
    **dict.fromkeys(overloads("exp2.default"), math.log(2.0)),
}
LOGARITHM_OPS = overloads("log.default", "log2.default", "log10.default")
POWER_OF_SCALAR_OPS = overloads("pow.Scalar")
POWER_BY_SCALAR_OPS = overloads("pow.Tensor_Scalar")
SUM_OPS = overloads(
    "add.Tensor", "sub.Tensor", "add.Scalar", "sub.Scalar", "rsub.Tensor", "rsub.Scalar"
)
