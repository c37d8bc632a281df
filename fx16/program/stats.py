"""Figures that describe a program's precision: weight bytes, casts, ops and FLOPs per dtype."""

import math
import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from fx16.ops.kinds import OpKind, target_kind
from fx16.ops.tables import ASSERT_METADATA_OPS, CAST_OPS, per_op
from fx16.program.casts import INSERTED, WHY_RETARGETED, is_cast, is_inserted
from fx16.program.cost import bytes_moved, flops
from fx16.program.nodes import dtype_name
from fx16.program.subgraphs import nested_graph_modules
from fx16.program.tensor_subclasses import inner_tensors

# graph_module.meta key: the program's ProgramStats before fx16 first changed it
BEFORE_KEY = "fx16.before"


@dataclass(frozen=True)
class ProgramStats:
    weight_bytes: int
    casts: int
    inserted_casts: int  # new cast nodes (the model's casts fx16 retargeted are not counted)
    ops_by_dtype: dict[str, int]  # compute ops by the float dtype they produce
    product_flops_by_dtype: dict[str, int]  # matmul/conv/attention FLOPs by the dtype computed
    cast_bytes: int = 0  # bytes the casts read and write per call
    fp32_weight_bytes: int = 0  # bytes of the fp32 state tensors

    def ops_in(self, dtype: torch.dtype) -> int:
        return self.ops_by_dtype.get(dtype_name(dtype), 0)

    @property
    def float_ops(self) -> int:
        return sum(self.ops_by_dtype.values())

    @property
    def product_flops(self) -> int:
        return sum(self.product_flops_by_dtype.values())

    @property
    def product_flops_16bit(self) -> int:
        return sum(self.product_flops_by_dtype.get(name, 0) for name in ("float16", "bfloat16"))

    @property
    def flop_share_16bit(self) -> float:
        """The share of matmul/conv/attention FLOPs computed in 16-bit."""
        return self.product_flops_16bit / self.product_flops if self.product_flops else 1.0


def program_stats(ep: ExportedProgram) -> ProgramStats:
    """Count what a cast changed: state bytes, cast nodes, float ops per dtype."""
    tensors = {id(t): t for t in (*ep.state_dict.values(), *ep.constants.values())}
    parts = [  # a tensor subclass (torchao's Int8Tensor) by its stored parts
        part
        for t in tensors.values()
        if isinstance(t, torch.Tensor)
        for part in inner_tensors(t).values()
    ]
    weight_bytes = sum(part.numel() * part.element_size() for part in parts)
    fp32_weight_bytes = sum(
        part.numel() * part.element_size() for part in parts if part.dtype == torch.float32
    )
    casts = inserted = cast_bytes = 0
    ops: Counter[str] = Counter()
    products: Counter[str] = Counter()
    for module in nested_graph_modules(ep.graph_module):  # bodies of higher-order ops too
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            role = _counted_as(node.target)
            if role == "skipped":
                continue
            if role == "cast" and is_cast(node):
                casts += 1
                inserted += is_inserted(node) and node.meta[INSERTED] != WHY_RETARGETED
                cast_bytes += bytes_moved(node)
                continue
            dtype = _float_result_dtype(node.meta.get("val"))
            if dtype is None:
                continue
            ops[dtype] += 1
            if role == "product":
                products[dtype] += flops(node)
    return ProgramStats(
        weight_bytes,
        casts,
        inserted,
        {dtype_name(dtype): count for dtype, count in ops.items()},
        {dtype_name(dtype): count for dtype, count in products.items()},
        cast_bytes,
        fp32_weight_bytes,
    )


def _float_result_dtype(val) -> torch.dtype | None:
    """The dtype an op computes in: its float result's, the first float one's for an op
    with several results (an LSTM's output and states, a layer norm's mean and rstd);
    None for an op with no float result."""
    if isinstance(val, torch.Tensor):  # most ops: one result, no tree to walk
        return val.dtype if val.dtype.is_floating_point else None
    for leaf in pytree.tree_leaves(val):
        if isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point:
            return leaf.dtype
    return None


@per_op
def _counted_as(target) -> str:
    """How ``program_stats`` counts an op's nodes: "skipped" (a dtype check, a getitem),
    "cast" (when ``is_cast`` agrees), "product" (``fx16.program.cost.is_product``) or "op"."""
    if target in ASSERT_METADATA_OPS or target is operator.getitem:
        return "skipped"
    if target in CAST_OPS:
        return "cast"
    return "product" if target_kind(target) == OpKind.COMPUTE else "op"


def record_stats_before(ep: ExportedProgram) -> ProgramStats:
    """The figures of ``ep`` before fx16 first changed it: recorded in its graph
    module's meta now unless they are already there (a second cast keeps the first's)."""
    meta = ep.graph_module.meta
    if BEFORE_KEY not in meta:
        meta[BEFORE_KEY] = program_stats(ep)
    return meta[BEFORE_KEY]


def relative_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    """max |reference - value| / max |reference| over the reference's finite elements, in fp64.

    inf where ``value`` is not finite but the reference is; the absolute error for an
    all-zero reference; 0 for empty tensors.
    """
    reference, value = reference.double(), value.double()
    finite = torch.isfinite(reference)
    if not bool(finite.any()):
        return 0.0
    reference, value = reference[finite], value[finite]
    if not bool(torch.isfinite(value).all()):
        return math.inf
    difference = (reference - value).abs().max().item()
    scale = reference.abs().max().item()
    return difference / scale if scale else difference


def nonfinite_mismatches(reference: torch.Tensor, value: torch.Tensor) -> int:
    """How many of the reference's inf and NaN elements ``value`` does not reproduce
    (``relative_error`` measures the finite ones only): -inf against a finite number,
    NaN against inf, ... An inf of the same sign, or NaN against NaN, matches."""
    if reference.shape != value.shape or not reference.is_floating_point():
        return 0
    reference, value = reference.double(), value.double()
    nonfinite = ~torch.isfinite(reference)
    if not bool(nonfinite.any()):
        return 0
    reference, value = reference[nonfinite], value[nonfinite]
    same = (reference == value) | (reference.isnan() & value.isnan())
    return int((~same).sum().item())


def outputs_error(reference: list, observed: list) -> float:
    """The largest ``relative_error`` over the float outputs of one call."""
    errors = [
        relative_error(ref, obs)
        for ref, obs in zip(reference, observed)
        if isinstance(ref, torch.Tensor) and ref.is_floating_point()
    ]
    return max(errors, default=0.0)
