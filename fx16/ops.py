"""Op tables: which ATen overloads fx16 treats specially.

Every op list the passes use lives here, so a pipeline that wants different
behaviour changes data, not pass code. Overloads missing from the installed
torch are skipped, so the tables work across the supported torch versions.
"""

import torch

aten = torch.ops.aten


def overloads(*names: str) -> frozenset:
    """Resolve "op.overload" names against torch.ops.aten, skipping unknown ones."""
    found = set()
    for name in names:
        op_name, _, overload = name.partition(".")
        packet = getattr(aten, op_name, None)
        if packet is None:
            continue
        op = getattr(packet, overload or "default", None)
        if op is not None:
            found.add(op)
    return frozenset(found)


# Ops that only change a tensor's dtype (and possibly copy it).
CAST_OPS = overloads("_to_copy.default", "to.dtype", "to.dtype_layout")

# Ops that make a new floating tensor from sizes and scalars (or from another
# tensor's shape): their precision is set by a ``dtype`` argument, not by inputs.
CREATION_OPS = overloads(
    "arange.default",
    "arange.start",
    "arange.start_step",
    "empty.memory_format",
    "empty_strided.default",
    "empty_like.default",
    "eye.default",
    "eye.m",
    "full.default",
    "full_like.default",
    "linspace.default",
    "logspace.default",
    "new_empty.default",
    "new_empty_strided.default",
    "new_full.default",
    "new_ones.default",
    "new_zeros.default",
    "ones.default",
    "ones_like.default",
    "rand.default",
    "rand_like.default",
    "randn.default",
    "randn_like.default",
    "scalar_tensor.default",
    "zeros.default",
    "zeros_like.default",
)

# Ops that only check metadata (dtype, device, shape); they must follow the dtype
# of the value they check.
ASSERT_METADATA_OPS = overloads("_assert_tensor_metadata.default")

# ---- integer narrowing ---------------------------------------------------------------

# Integer ops whose tensor-tensor form seeds the int16 castable set.
INT16_COMPUTE_OPS = overloads("add.Tensor", "sub.Tensor", "mul.Tensor")


def _positions(table: dict[str, tuple[int, ...]]) -> dict:
    return {op: positions for name, positions in table.items() for op in overloads(name)}


# Where an op takes index tensors: op -> positions of index arguments (a position may
# hold a list of tensors, as in index.Tensor). A value flowing into one of these must
# keep its dtype. Sizes taken from tensors (item(), repeat_interleave counts) count too.
INDEX_ARGUMENTS = _positions(
    {
        "embedding.default": (1,),
        "embedding_bag.default": (1, 2),
        "embedding_bag.padding_idx": (1, 2),
        "_embedding_bag.default": (1, 2),
        "gather.default": (2,),
        "take.default": (1,),
        "take_along_dim.default": (1,),
        "index_select.default": (2,),
        "index.Tensor": (1,),
        "_unsafe_index.Tensor": (1,),
        "index_put.default": (1,),
        "index_put_.default": (1,),
        "_unsafe_index_put.default": (1,),
        "_index_put_impl_.default": (1,),
        "scatter.src": (2,),
        "scatter.value": (2,),
        "scatter.reduce": (2,),
        "scatter.value_reduce": (2,),
        "scatter_add.default": (2,),
        "scatter_reduce.two": (2,),
        "index_add.default": (2,),
        "index_copy.default": (2,),
        "index_fill.int_Scalar": (2,),
        "index_fill.int_Tensor": (2,),
        "one_hot.default": (0,),
        "nll_loss.default": (1,),
        "nll_loss_forward.default": (1,),
        "nll_loss2d_forward.default": (1,),
        "nll_loss_nd.default": (1,),
        "cross_entropy_loss.default": (1,),
        "_local_scalar_dense.default": (0,),
        "item.default": (0,),
        "repeat_interleave.Tensor": (0,),
        "narrow.Tensor": (2,),
    }
)

# Ops whose output values are all values of some inputs (data movement): op -> the
# positions of those inputs (a position may hold a list of tensors, as in cat).
VALUE_PRESERVING_OPS = _positions(
    {
        "alias.default": (0,),
        "as_strided.default": (0,),
        "cat.default": (0,),
        "chunk.default": (0,),
        "clone.default": (0,),
        "contiguous.default": (0,),
        "detach.default": (0,),
        "expand.default": (0,),
        "flatten.using_ints": (0,),
        "flip.default": (0,),
        "gather.default": (0,),
        "index.Tensor": (0,),
        "index_select.default": (0,),
        "narrow.default": (0,),
        "permute.default": (0,),
        "repeat.default": (0,),
        "reshape.default": (0,),
        "roll.default": (0,),
        "select.int": (0,),
        "slice.Tensor": (0,),
        "split.Tensor": (0,),
        "split_with_sizes.default": (0,),
        "squeeze.default": (0,),
        "squeeze.dim": (0,),
        "squeeze.dims": (0,),
        "stack.default": (0,),
        "t.default": (0,),
        "transpose.int": (0,),
        "unbind.int": (0,),
        "unsqueeze.default": (0,),
        "view.default": (0,),
        "_unsafe_view.default": (0,),
        "where.self": (1, 2),
        "amax.default": (0,),
        "amin.default": (0,),
        "max.default": (0,),
        "min.default": (0,),
        "lift_fresh_copy.default": (0,),
    }
)

# Ops returning positions along their ``dim`` argument: op -> which output (None: the only one).
POSITION_OPS = {
    **{op: None for op in overloads("argmax.default", "argmin.default")},
    **{op: 1 for op in overloads("topk.default", "sort.default", "sort.stable")},
    **{op: 1 for op in overloads("max.dim", "min.dim")},
}

# Integer dtypes fx16 narrows to int16.
WIDE_INT_DTYPES = frozenset({torch.int32, torch.int64})
INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})

# ---- infinity-like sentinels (finfo.min masks) ------------------------------------------

# Ops that turn a -65504 (saturated finfo.min) input into the same result as -3.4e38:
# softmax and exp give 0, comparisons keep the order, attention applies its mask by softmax.
SENTINEL_ABSORBING_OPS = overloads(
    "softmax.int",
    "_softmax.default",
    "_safe_softmax.default",
    "exp.default",
    "sigmoid.default",
    "eq.Tensor",
    "eq.Scalar",
    "ne.Tensor",
    "ne.Scalar",
    "lt.Tensor",
    "lt.Scalar",
    "le.Tensor",
    "le.Scalar",
    "gt.Tensor",
    "gt.Scalar",
    "ge.Tensor",
    "ge.Scalar",
    "scaled_dot_product_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "_scaled_dot_product_efficient_attention.default",
)

# Ops that hand a sentinel on as a sentinel (adding a mask, selecting, moving data).
SENTINEL_PASSING_OPS = overloads(
    "add.Tensor",
    "sub.Tensor",
    "masked_fill.Scalar",
    "masked_fill.Tensor",
    "where.self",
    "maximum.default",
    "minimum.default",
    "amax.default",
    "amin.default",
    "max.dim",
    "min.dim",
    "_to_copy.default",
    "to.dtype",
    "to.dtype_layout",
) | frozenset(op for op, positions in VALUE_PRESERVING_OPS.items())
