"""Op tables: which ATen overloads fx16 treats specially.

The op lists the passes use are data, so a pipeline that wants different behaviour
changes tables, not pass code: this module (casts, creation ops, value-preserving
ops, sentinels), ``fx16.ops.numeric_tables`` (underflow and conditioning),
``fx16.ops.kinds`` (the policies' op kinds), ``fx16.ops.int_ops`` (int16 narrowing) and
``fx16.ops.autocast`` (torch.autocast's lists). A name that resolves to no overload of
the installed torch raises ``LookupError`` (a typo would make a rule that never fires),
unless a table lists it as optional, for an op some supported torch lacks.
"""

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


# Every name a table declared optional (an op some supported torch lacks) that the
# installed torch does not have: skipped, and listed (tests/test_tables.py holds this list
# empty on the torch the project is tested with).
UNRESOLVED: list[str] = []


def overloads(*names: str, optional: tuple[str, ...] = ()) -> frozenset:
    """Resolve "op.overload" names against torch.ops.aten. A name that does not resolve
    raises ``LookupError`` (a typo would make a rule that never fires), unless it is
    also in ``optional`` (an op some supported torch lacks): then it is skipped and
    recorded in ``UNRESOLVED``."""
    found = set()
    for name in (*names, *optional):
        op_name, _, overload = name.partition(".")
        packet = getattr(aten, op_name, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is not None:
            found.add(op)
        else:
            _unresolved(name, optional)
    return frozenset(found)


def _unresolved(name: str, optional: tuple[str, ...]) -> None:
    if name not in optional:
        raise LookupError(
            f"fx16.ops.tables: {name!r} names no ATen op of torch {torch.__version__} "
            "(a typo, or an op some torch lacks: list it in optional=)"
        )
    UNRESOLVED.append(name)


# Namespaces whose ops fx16 knows by their ATen semantics. Ops from any other
# namespace (coreai, quantized_decomposed, torchao, a user's torch.library ops) are
# custom: fx16 learns what they compute only from their fake kernels.
BUILTIN_NAMESPACES = frozenset({"aten", "prims"})


def per_op(compute: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``compute(target)``, asked once per op: a fact of an op (its schema, its kind)
    is asked of every node that calls it. Cached by the op's id, holding the op (so the
    id stays its own): an op's ``__hash__`` is Python code, and a dict look-up through
    it costs as much as the question."""
    cache: dict[int, tuple[Any, Any]] = {}

    def cached(target: Any) -> Any:
        found = cache.get(id(target))
        if found is not None and found[0] is target:
            return found[1]
        answer = compute(target)
        cache[id(target)] = (target, answer)
        return answer

    cached.__doc__ = compute.__doc__
    cached.__name__ = compute.__name__
    return cached


@per_op
def is_custom_op(target) -> bool:
    """``target`` is an op outside aten/prims (``torch.ops.coreai.dequantize``...)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in BUILTIN_NAMESPACES


# The scalar that leaves a value as it is, by op name: ``x * 1``, ``x / 1``, ``x + 0``,
# ``x - 0`` (their in-place forms too).
NEUTRAL_SCALARS = {"mul": 1, "div": 1, "add": 0, "sub": 0}

# Ops that only change a tensor's dtype (and possibly copy it).
CAST_OPS = overloads("_to_copy.default", "to.dtype", "to.dtype_layout")


@per_op
def is_cast_op(target) -> bool:
    """``target`` is one of ``CAST_OPS`` (a node calling it may still keep its dtype)."""
    return target in CAST_OPS


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

# ---- ops without a 16-bit kernel --------------------------------------------------------


def every_overload(*packets: str, optional: tuple[str, ...] = ()) -> frozenset:
    """Every overload of each named op packet that the installed torch has; a packet it
    lacks raises ``LookupError`` unless it is in ``optional`` (see ``overloads``)."""
    found = set()
    for name in (*packets, *optional):
        packet = getattr(aten, name, None)
        if packet is None:
            _unresolved(name, optional)
        else:
            found.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(found)


# Ops with no fp16 or bf16 kernel on the CPU (``"..." not implemented for 'Half'``, "MKL
# FFT doesn't support tensors of type: Half"): fed 16-bit values, the program fails
# where the fp32 one runs. Eager autocast keeps the FFTs and the decompositions fp32 on
# every device; so does fx16 (``NoLowKernelRule``). tests/test_no_low_kernel.py checks the
# table against every op of PyTorch's op database whose CPU dtypes lack float16.
NO_LOW_KERNEL_OPS = every_overload(
    # FFTs: the torch.fft functions as exported, and what they decompose into
    *(
        f"fft_{kind}{suffix}"
        for kind in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")
        for suffix in ("", "2", "n")
    ),
    "_fft_r2c",
    "_fft_c2c",
    "_fft_c2r",
    "stft",
    "istft",
    # linear algebra: factorizations, solves, inverses, determinants
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "geqrf",
    "ormqr",
    "triangular_solve",
    "linalg_cholesky_ex",
    "linalg_eig",
    "_linalg_eigh",
    "linalg_householder_product",
    "linalg_inv_ex",
    "linalg_ldl_factor_ex",
    "linalg_ldl_solve",
    "linalg_lu",
    "linalg_lu_factor_ex",
    "linalg_lu_solve",
    "linalg_pinv",
    "linalg_qr",
    "_linalg_slogdet",
    "_linalg_solve_ex",
    "linalg_solve_triangular",
    "_linalg_svd",
    # distances, histograms, pooling, losses and resampling without a Half CPU kernel
    "_cdist_forward",
    "_histogramdd_bin_edges",
    "_histogramdd_from_bin_cts",
    "histogram",
    "avg_pool3d",
    "_ctc_loss",
    "multi_margin_loss",
    "multilabel_margin_loss_forward",
    "_upsample_bilinear2d_aa",
    "rrelu_with_noise",
    "polar",
    "sparse_sampled_addmm",
    # special functions
    "special_airy_ai",
    "special_bessel_j0",
    "special_bessel_j1",
    "special_bessel_y0",
    "special_bessel_y1",
    "special_erfcx",
    "special_log_ndtr",
    "special_modified_bessel_i0",
    "special_modified_bessel_i1",
    "special_modified_bessel_k0",
    "special_modified_bessel_k1",
    "special_ndtri",
    "special_scaled_modified_bessel_k0",
    "special_scaled_modified_bessel_k1",
    "special_spherical_bessel_j0",
    "special_zeta",
    *(
        f"special_{kind}_polynomial_{letter}"
        for kind, letters in (
            ("chebyshev", "tuvw"),
            ("shifted_chebyshev", "tuvw"),
            ("hermite", ("h", "he")),
            ("laguerre", "l"),
            ("legendre", "p"),
        )
        for letter in letters
    ),
)

# ---- ops that keep the values they are given ---------------------------------------


def positions_table(table: dict[str, tuple[int, ...]]) -> dict:
    return {op: positions for name, positions in table.items() for op in overloads(name)}


# Ops whose output values are all values of some inputs (data movement): op -> the
# positions of those inputs (a position may hold a list of tensors, as in cat).
VALUE_PRESERVING_OPS = positions_table(
    {
        "alias.default": (0,),
        "as_strided.default": (0,),
        "cat.default": (0,),
        "chunk.default": (0,),
        "clone.default": (0,),
        "contiguous.default": (0,),
        "copy_.default": (1,),
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
