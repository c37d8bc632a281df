"""What an op costs where it runs: FLOPs and bytes moved, from the shapes export recorded.

A 16-bit cast pays off in the matrix products, convolutions and attention (the
"products"): on a GPU or the Neural Engine they run 8-16x faster in 16-bit, and
they are nearly all of a model's arithmetic. So fx16 counts, for every op, the
FLOPs it computes (a multiply-add is two) and the bytes it reads and writes, and
states every decision to keep something in fp32 in those terms.

Products count two FLOPs per multiply-add, as ``torch.utils.flop_counter`` does
(``mm``, ``bmm``, ``addmm``, ``linear``, ``matmul``, ``einsum``, convolutions and
their transposes, ``scaled_dot_product_attention`` and its kernels, ``mv``, ``dot``,
grouped products of mixtures of experts, quantized and scaled products, recurrent
layers: lstm, gru, rnn_tanh, rnn_relu and their cells, where every weight matrix meets
every step of the sequence; a bias added is not counted); any other op
counts one FLOP per element it produces or reads, whichever is more. Symbolic
sizes count at the size export traced them with; each body of a higher-order op counts
once (a loop's body once, both branches of a cond).
"""

import math
import operator

import torch
import torch.utils._pytree as pytree
from torch.fx import Node

from fx16.ops.kinds import RECURRENT_OPS, OpKind, op_kind, op_name
from fx16.program.nodes import node_val


def is_product(node: Node) -> bool:
    """A matrix product, convolution or attention op: where 16-bit pays off most."""
    return node.op == "call_function" and op_kind(node) == OpKind.COMPUTE


def flops(node: Node) -> int:
    """The FLOPs ``node``'s op computes (0 for placeholders, getitem and non-tensor ops)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0
    name = op_name(node)
    shapes = [_shape(arg) for arg in node.args]
    if name in _PRODUCTS:
        try:
            return int(_PRODUCTS[name](node, shapes))
        except (IndexError, TypeError, ValueError):
            pass  # an unusual signature: count it by its elements
    return max([_numel(leaf) for leaf in _tensors(node)], default=0)


def elements(node: Node) -> int:
    """The elements ``node``'s op produces (its result's tensors together)."""
    if node.op != "call_function":
        return 0
    value = node_val(node)
    if isinstance(value, torch.Tensor):
        return _numel(value)
    return sum(_numel(leaf) for leaf in pytree.tree_leaves(value) if _is_tensor(leaf))


def bytes_moved(node: Node) -> int:
    """Bytes ``node`` reads (its tensor inputs) and writes (its tensor results)."""
    return sum(tensor_bytes(node_val(arg)) for arg in node.all_input_nodes) + tensor_bytes(
        node_val(node)
    )


def tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (a node's recorded value)."""
    return sum(
        _numel(leaf) * leaf.element_size()
        for leaf in pytree.tree_leaves(value)
        if isinstance(leaf, torch.Tensor)
    )


def _size(size) -> int:
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 1
    return int(size)


def _numel(tensor: torch.Tensor) -> int:
    return math.prod(_sizes(tensor.shape))


def _sizes(shape) -> list[int]:
    """A shape's sizes as ints (a symbolic one at its hint): the shape itself where every
    size is an int already, the common case."""
    if all(type(size) is int for size in shape):
        return shape
    return [_size(size) for size in shape]


def _shape(arg) -> list[int] | None:
    val = node_val(arg)
    return list(_sizes(val.shape)) if isinstance(val, torch.Tensor) else None


def _tensors(node: Node) -> list[torch.Tensor]:
    values = [node_val(arg) for arg in node.all_input_nodes] + [node_val(node)]
    return [leaf for value in values for leaf in pytree.tree_leaves(value) if _is_tensor(leaf)]


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _out_numel(node: Node) -> int:
    value = node_val(node)
    if isinstance(value, torch.Tensor):  # most products: one result, no tree to walk
        return _numel(value)
    leaves = [leaf for leaf in pytree.tree_leaves(value) if _is_tensor(leaf)]
    return _numel(leaves[0]) if leaves else 0


def _matmul(node: Node, shapes: list) -> int:
    """2 K per output element, K the contracted size (a's last dim)."""
    a = shapes[0]
    return 2 * _out_numel(node) * a[-1] if len(a) > 1 else 2 * a[0]


def _addmm(node: Node, shapes: list) -> int:  # (bias, a, b), (self, batch1, batch2)
    return 2 * _out_numel(node) * shapes[1][-1]


def _linear(node: Node, shapes: list) -> int:  # (x, weight[N, K], bias)
    return 2 * _out_numel(node) * shapes[1][-1]


def _convolution(node: Node, shapes: list) -> int:
    """2 multiply-adds per (output element, input channel of its group, kernel tap);
    a transposed convolution scatters each input element to its outputs instead."""
    weight = shapes[1]
    per_element = math.prod(weight[1:])
    transposed = node.args[6] if op_name(node) in ("convolution", "_convolution") else False
    if transposed or "conv_transpose" in op_name(node):
        return 2 * math.prod(shapes[0]) * per_element
    return 2 * _out_numel(node) * per_element


def _attention(node: Node, shapes: list) -> int:
    """q k^T and the weights times v: 2 L S (E + Ev) per batch and head."""
    query, key, value = shapes[:3]
    batch = math.prod(query[:-2])
    length, source = query[-2], key[-2]
    return 2 * batch * length * source * (query[-1] + value[-1])


def _attention_by_length(node: Node, shapes: list) -> int:
    """The same, for kernels that take (batch, length, heads, features)."""
    query, key, value = shapes[:3]
    batch, length, heads = query[:3]
    return 2 * batch * heads * length * key[1] * (query[-1] + value[-1])


def _multi_head_attention(node: Node, shapes: list) -> int:
    """The input projections of q, k and v, the attention, and the output projection:
    (batch, length, embedding) in, ``num_head`` heads."""
    query, key = shapes[:2]
    rows, embedding = math.prod(query[:-1]), query[-1]
    sources = math.prod(key[:-1])
    return 2 * (rows + 2 * sources) * embedding * embedding + 2 * rows * embedding * (
        2 * key[-2] + embedding
    )


def _conv_tbc(node: Node, shapes: list) -> int:  # (input[T, B, Cin], weight[K, Cin, Cout])
    return 2 * _out_numel(node) * shapes[1][0] * shapes[1][1]


def _bilinear(node: Node, shapes: list) -> int:  # (x1[.., I1], x2[.., I2], weight[O, I1, I2])
    return 2 * _out_numel(node) * shapes[2][1] * shapes[2][2]


def _tensordot(node: Node, shapes: list) -> int:
    """2 per output element and contracted combination (``dims_self`` of a)."""
    a, dims = shapes[0], node.args[2]
    return 2 * _out_numel(node) * math.prod(a[d] for d in dims)


def _vecdot(node: Node, shapes: list) -> int:  # (x, y, dim): a dot product per element
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    return 2 * _out_numel(node) * shapes[0][dim]


def _chain(node: Node, shapes: list) -> int:
    """Matrices multiplied left to right: 2 m k n for each product."""
    matrices = [_shape(matrix) for matrix in node.args[0]]
    total, rows = 0, matrices[0][0]
    for left, right in zip(matrices, matrices[1:]):
        total += 2 * rows * left[-1] * right[-1]
    return total


def _recurrent(node: Node, shapes: list) -> int:
    """2 per weight element and step: every layer's (and direction's) input, hidden and
    projection matrices meet each (step, batch) row of the input."""
    rows = math.prod(shapes[0][:-1])
    weights = node.args[2]  # the flat weight list of a sequence op
    if not isinstance(weights, (list, tuple)):  # a cell: (input, hx, w_ih, w_hh, ...)
        weights = node.args[2:4]
    matrices = [_shape(weight) for weight in weights]
    return 2 * rows * sum(math.prod(shape) for shape in matrices if shape and len(shape) == 2)


def _einsum(node: Node, shapes: list) -> int:
    """2 per combination of every index the equation names (a sum of products)."""
    equation = node.args[0].replace(" ", "")
    if "..." in equation:
        raise ValueError("broadcast dimensions: counted by elements")
    sizes = {}
    for letters, arg in zip(equation.split("->")[0].split(","), node.args[1]):
        sizes.update(zip(letters, _shape(arg)))
    return 2 * math.prod(sizes.values())


_PRODUCTS = {
    "mm": _matmul,
    "bmm": _matmul,
    "matmul": _matmul,
    "linalg_matmul": _matmul,
    "inner": _matmul,
    "_int_mm": _matmul,
    "_scaled_mm": _matmul,
    "_scaled_mm_v2": _matmul,
    "_weight_int8pack_mm": _matmul,  # (x[M, K], weight, scales): 2 K per output element
    "_weight_int4pack_mm": _matmul,
    "_weight_int4pack_mm_for_cpu": _matmul,
    "_weight_int4pack_mm_with_scales_and_zeros": _matmul,
    "_dyn_quant_matmul_4bit": _matmul,
    "tensordot": _tensordot,
    "linalg_vecdot": _vecdot,
    "chain_matmul": _chain,
    "linalg_multi_dot": _chain,
    "bilinear": _bilinear,
    "mv": _matmul,
    "dot": _matmul,
    "vdot": _matmul,
    "addmm": _addmm,
    "_addmm_activation": _addmm,
    "addmv": _addmm,
    "baddbmm": _addmm,
    "addbmm": _addmm,
    "linear": _linear,
    "mkldnn_linear": _linear,
    "_mixed_dtypes_linear": _linear,
    "einsum": _einsum,
    "convolution": _convolution,
    "_convolution": _convolution,
    "_convolution_mode": _convolution,
    "mkldnn_convolution": _convolution,
    "thnn_conv2d": _convolution,
    "_slow_conv2d_forward": _convolution,
    "slow_conv3d": _convolution,
    "slow_conv3d_forward": _convolution,
    "slow_conv_dilated2d": _convolution,
    "slow_conv_dilated3d": _convolution,
    "slow_conv_transpose2d": _convolution,
    "slow_conv_transpose3d": _convolution,
    "conv_tbc": _conv_tbc,
    "conv1d": _convolution,
    "conv2d": _convolution,
    "conv3d": _convolution,
    "conv_transpose1d": _convolution,
    "conv_transpose2d": _convolution,
    "conv_transpose3d": _convolution,
    "_grouped_mm": _matmul,  # each row meets one group's weight: 2 K per output element
    "_scaled_grouped_mm": _matmul,
    "_scaled_grouped_mm_v2": _matmul,
    "grouped_mm_fallback": _matmul,
    **dict.fromkeys(RECURRENT_OPS, _recurrent),
    "scaled_dot_product_attention": _attention,
    "_scaled_dot_product_flash_attention": _attention,
    "_scaled_dot_product_flash_attention_for_cpu": _attention,
    "_scaled_dot_product_efficient_attention": _attention,
    "_scaled_dot_product_attention_math": _attention,
    "_scaled_dot_product_fused_attention_overrideable": _attention,
    "_scaled_dot_product_cudnn_attention": _attention,
    "_flash_attention_forward": _attention_by_length,
    "_efficient_attention_forward": _attention_by_length,
    "_native_multi_head_attention": _multi_head_attention,
}
