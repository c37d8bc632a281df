"""Op tables for narrowing integers to int16: which ops compute in int16, where an op
reads indices or positions, which integer dtypes there are.

Overloads missing from the installed torch are skipped (``fx16.ops.tables.overloads``).
"""

import torch

from fx16.ops.tables import overloads, positions_table

aten = torch.ops.aten

# Integer ops whose tensor-tensor form seeds the int16 castable set.
INT16_COMPUTE_OPS = overloads("add.Tensor", "sub.Tensor", "mul.Tensor")


# Where an op takes index tensors: op -> positions of index arguments (a position may
# hold a list of tensors, as in index.Tensor). A value flowing into one of these must
# keep its dtype. Sizes taken from tensors (item(), repeat_interleave counts) count too.
INDEX_ARGUMENTS = positions_table(
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
        "index_add_.default": (2,),
        "index_copy.default": (2,),
        "index_copy_.default": (2,),
        "index_fill.int_Scalar": (2,),
        "index_fill.int_Tensor": (2,),
        "index_fill_.int_Scalar": (2,),
        "index_fill_.int_Tensor": (2,),
        "scatter_.src": (2,),
        "scatter_.value": (2,),
        "scatter_add_.default": (2,),
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


# Ops returning positions along their ``dim`` argument: op -> which output (None: the only one).
POSITION_OPS = {
    **{op: None for op in overloads("argmax.default", "argmin.default")},
    **{op: 1 for op in overloads("topk.default", "sort.default", "sort.stable")},
    **{op: 1 for op in overloads("max.dim", "min.dim")},
}

# Ops that select positions by comparing values: their indices are valid whatever the
# precision of those values (it changes which index is chosen, never whether it is in
# range): op -> which output holds the indices (None: the only one).
SELECTION_OPS = {**POSITION_OPS, **{op: None for op in overloads("multinomial.default")}}

# Which dimension an index argument indexes (fx16.analysis.index_bounds): op -> (position
# of the indexed tensor, name of the dim argument or the fixed dim, position of the
# index, lowest valid index as a multiple of -N: 1 if negative ones count).
INDEXED_DIMENSIONS = {
    **dict.fromkeys(
        overloads(
            "index_fill.int_Scalar",
            "index_fill.int_Tensor",
            "index_fill_.int_Scalar",
            "index_fill_.int_Tensor",
        ),
        (0, "dim", 2, 1),
    ),
    **dict.fromkeys(
        overloads(
            "index_copy.default",
            "index_copy_.default",
            "index_add.default",
            "index_add_.default",
            "index_select.default",
            "gather.default",
            "scatter.src",
            "scatter.value",
            "scatter_.src",
            "scatter_.value",
            "scatter_add.default",
            "scatter_add_.default",
        ),
        (0, "dim", 2, 0),
    ),
    **dict.fromkeys(overloads("embedding.default"), (0, 0, 1, 0)),
}
# ops taking a list of index tensors, one per leading dimension (None: the whole dim)
INDEX_LIST_OPS = overloads(
    "index.Tensor", "_unsafe_index.Tensor", "index_put.default", "index_put_.default"
)

# Integer dtypes fx16 narrows to int16.
WIDE_INT_DTYPES = frozenset({torch.int32, torch.int64})
INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
