"""Op kinds for precision policies (products, reductions, data movement), by overload
packet name, the kind of a node (``op_kind``), and whether fx16 knows an op's precision
behaviour at all."""

import enum
import operator

import torch
from torch.fx import Node

from fx16.ops.tables import CAST_OPS, CREATION_OPS, VALUE_PRESERVING_OPS, per_op


def packets(*names: str) -> frozenset[str]:
    """Op names (overload packets) as they appear in ``node.target._opname``."""
    return frozenset(names)


# Recurrent layers over a sequence or one step: a matrix product per gate and step.
RECURRENT_OPS = packets(
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
)

# Attention kernels: a product of queries and keys, then of the weights and the values.
ATTENTION_OPS = packets(
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",  # (batch, length, heads, features) layout
    "_efficient_attention_forward",
    "_native_multi_head_attention",  # with its input and output projections
)

# Matrix products and convolutions, in every form ATen has (the kernels a decomposition
# or a backend lowers to, quantized and scaled products): where 16-bit pays off most.
COMPUTE_OPS = (
    RECURRENT_OPS
    | ATTENTION_OPS
    | packets(
        "mm",
        "bmm",
        "addmm",
        "addbmm",
        "baddbmm",
        "matmul",
        "linalg_matmul",
        "linear",
        "bilinear",
        "einsum",
        "tensordot",
        "inner",
        "linalg_vecdot",
        "chain_matmul",
        "linalg_multi_dot",
        "conv1d",
        "conv2d",
        "conv3d",
        "convolution",
        "_convolution",
        "_convolution_mode",
        "conv_tbc",
        "mkldnn_convolution",
        "thnn_conv2d",
        "_slow_conv2d_forward",
        "slow_conv3d",
        "slow_conv3d_forward",
        "slow_conv_dilated2d",
        "slow_conv_dilated3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "slow_conv_transpose2d",
        "slow_conv_transpose3d",
        "addmv",
        "mv",
        "dot",
        "vdot",
        "_addmm_activation",
        "mkldnn_linear",
        "_mixed_dtypes_linear",
        "_int_mm",
        "_weight_int8pack_mm",
        "_weight_int4pack_mm",
        "_weight_int4pack_mm_for_cpu",
        "_weight_int4pack_mm_with_scales_and_zeros",
        "_dyn_quant_matmul_4bit",
        "_scaled_mm",
        "_scaled_mm_v2",
        "_grouped_mm",
        "_scaled_grouped_mm",
        "_scaled_grouped_mm_v2",
        "grouped_mm_fallback",  # transformers' mixture-of-experts kernel, as exported
    )
)

# How a value's magnitude grows when a program's float inputs are scaled by s, as s ** d
# (fx16.report.envelope): attention grows as its values do; the other products (and mul)
# multiply their operands' growth; these give values bounded whatever the scale (norms,
# softmax, saturating functions, comparisons); these grow faster than any power.
GROWTH_MULTIPLYING_OPS = (COMPUTE_OPS - ATTENTION_OPS - RECURRENT_OPS) | packets("mul")
SCALE_BOUNDED_OPS = packets(
    "lstm",  # the outputs are tanh-bounded states (a cell state grows with the steps only)
    "gru",
    "rnn_tanh",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "softmax",
    "_softmax",
    "_safe_softmax",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "native_group_norm",
    "rms_norm",
    "_fused_rms_norm",
    "instance_norm",
    "batch_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "sigmoid",
    "tanh",
    "sin",
    "cos",
    "erf",
    "sign",
    "log",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "argmax",
    "argmin",
)
EXPONENTIAL_GROWTH_OPS = packets("exp", "exp2", "expm1")

# Ops that accumulate over many elements: normalisations, softmax, sums, losses.
REDUCTION_OPS = packets(
    "softmax",
    "_softmax",
    "log_softmax",
    "_log_softmax",
    "_safe_softmax",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "native_group_norm",
    "batch_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
    "rms_norm",
    "_fused_rms_norm",
    "sum",
    "mean",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "cumsum",
    "cumprod",
    "prod",
    "norm",
    "linalg_vector_norm",
    "logsumexp",
    "nll_loss",
    "nll_loss_forward",
    "cross_entropy_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "kl_div",
    "binary_cross_entropy_with_logits",
    "amax",
    "amin",
)

# Ops that move or select data without arithmetic.
DATA_MOVEMENT_OPS = packets(
    *(op._opname for op in VALUE_PRESERVING_OPS),
    "select_scatter",
    "slice_scatter",
    "index_put",
    "scatter",
    "embedding",
    "pad",
    "constant_pad_nd",
    "repeat_interleave",
    "masked_fill",
    "tril",
    "triu",
    "roll",
    "dropout",
    "native_dropout",
)

# Ops whose accuracy is why a model opens an fp32 region itself (x.float() before a variance,
# a softmax, a rotary embedding): a region without any of them is not kept in fp32.
PRECISION_SENSITIVE_OPS = REDUCTION_OPS | packets(
    "pow",
    "rsqrt",
    "sqrt",
    "reciprocal",
    "exp",
    "expm1",
    "log",
    "log1p",
    "log2",
    "log10",
    "sin",
    "cos",
    "erf",
    "erfinv",
    "div",
    "logsumexp",
)


class OpKind(str, enum.Enum):
    COMPUTE = "compute"  # matmul, linear, conv, attention
    REDUCTION = "reduction"  # softmax, norms, sum/mean/var, cumsum, losses
    ELEMENTWISE = "elementwise"  # everything else that computes
    DATA_MOVEMENT = "data_movement"  # view, permute, cat, slice, gather...
    BOUNDARY = "boundary"  # user inputs and parameters/buffers/constants


def op_name(node: Node) -> str | None:
    """The overload packet name of a call's op ("linear" for aten.linear.default)."""
    return getattr(node.target, "_opname", None) if node.op == "call_function" else None


def op_kind(node: Node) -> OpKind:
    if node.op == "placeholder":
        return OpKind.BOUNDARY
    return target_kind(node.target if node.op == "call_function" else None)


def target_kind(target) -> OpKind:
    """The kind of a call's op (``op_kind`` of its nodes)."""
    name = getattr(target, "_opname", None)
    if name in COMPUTE_OPS:
        return OpKind.COMPUTE
    if name in REDUCTION_OPS:
        return OpKind.REDUCTION
    if name in DATA_MOVEMENT_OPS:
        return OpKind.DATA_MOVEMENT
    return OpKind.ELEMENTWISE


@per_op
def is_known_op(target) -> bool:
    """An op whose precision behaviour fx16 knows: one of its op-kind tables (products,
    reductions, data movement), a cast or creation op, or an ATen op tagged pointwise
    (it computes in its inputs' dtype, element by element). Anything else computes
    16-bit as its inputs are, and the report says it was not known."""
    return _known_op(target)


def _known_op(target) -> bool:
    try:
        hash(target)
    except TypeError:  # not hashable: not an op
        return False
    if target in CAST_OPS or target in CREATION_OPS or target is operator.getitem:
        return True
    name = getattr(target, "_opname", None)
    if name in COMPUTE_OPS or name in REDUCTION_OPS or name in DATA_MOVEMENT_OPS:
        return True
    return torch.Tag.pointwise in getattr(target, "tags", ())
