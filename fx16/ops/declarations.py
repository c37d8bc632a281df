"""How ops outside ATen treat dtypes and scales: a public registry (``fx16.declare_op``).

fx16 knows ATen's ops from its tables. A custom op (a quantizer's dequantize, a vendor
kernel) shows only its schema and its fake kernel, which do not say what a cast needs:

- ``output_dtype``: the argument that sets the dtype of its float result. Where the op
  computes in 16-bit, fx16 passes the 16-bit dtype there; an argument not passed (or
  passed None) counts as ``output_dtype_default`` (float32 unless declared). Without a
  declaration, a dequantize that returns fp32 unless told otherwise makes every product
  reading it fp32.
- ``linear_in``: the arguments its result scales with: ``op(s a) = s op(a)`` for any
  positive ``s`` (a dequantize's ``scale``). A scale domain may carry those arguments,
  and so its result, at a power of two (a block scale below fp16's normal range is
  carried at ``2**k`` and taken back after the product that reads the result).

Declared here: ``quantized_decomposed``'s dequantize ops (PT2E's ``convert_pt2e``),
torchao's ``dequantize_affine``, Core AI's dequantize ops. A user declares their own
before the cast::

    fx16.declare_op(torch.ops.mylib.dequant.default, output_dtype="out_dtype",
                    linear_in=("scale",))
"""

from dataclasses import dataclass

import torch

from fx16.errors import InvalidOptionError


@dataclass(frozen=True)
class OpDeclaration:
    """How one op treats dtypes and scales (see the module)."""

    output_dtype: str | None = None
    output_dtype_default: torch.dtype = torch.float32
    linear_in: tuple[str, ...] = ()


# The ops fx16 declares itself (a user's declarations join them).
_DECLARED: dict[str, OpDeclaration] = {
    "quantized_decomposed::dequantize_per_tensor": OpDeclaration("out_dtype", linear_in=("scale",)),
    "quantized_decomposed::dequantize_per_channel": OpDeclaration(
        "out_dtype", linear_in=("scales",)
    ),
    "quantized_decomposed::dequantize_per_channel_group": OpDeclaration(
        "output_dtype", linear_in=("scales",)
    ),
    "quantized_decomposed::dequantize_per_token": OpDeclaration(
        "output_dtype", linear_in=("scales",)
    ),
    "torchao::dequantize_affine": OpDeclaration("output_dtype", linear_in=("scale",)),
    # Core AI's (coreai_torch): the result takes the scale's (or the table's) dtype, so no
    # argument needs setting; each is linear in its scale, lookup table or kept values.
    "coreai::constexpr_blockwise_shift_scale": OpDeclaration(linear_in=("scale",)),
    "coreai::dequantize": OpDeclaration(linear_in=("scale",)),
    "coreai::lut_to_dense": OpDeclaration(linear_in=("lut",)),
    "coreai::sparse_to_dense": OpDeclaration(linear_in=("nonzero_data",)),
}


def declare_op(
    op,
    *,
    output_dtype: str | None = None,
    output_dtype_default: torch.dtype = torch.float32,
    linear_in: tuple[str, ...] | list[str] = (),
) -> OpDeclaration:
    """Declare how ``op`` (an ``OpOverload``, an ``OpOverloadPacket`` for all its
    overloads, or its name: "mylib::dequant" or "mylib::dequant.default") treats dtypes
    and scales; a later declaration of the same op replaces an earlier one. Returns the
    declaration. Raises ``InvalidOptionError`` for anything else, and for an argument
    its schema does not have (where the op is registered)."""
    name = _name(op)
    declared = OpDeclaration(output_dtype, output_dtype_default, tuple(linear_in))
    for overload in _registered_overloads(name):
        known = {argument.name for argument in overload._schema.arguments}
        wanted = {*declared.linear_in, *([output_dtype] if output_dtype else [])}
        if wanted - known:
            raise InvalidOptionError(
                f"declare_op: {overload} has no argument {', '.join(sorted(wanted - known))} "
                f"(it takes {', '.join(sorted(known))})"
            )
    _DECLARED[name] = declared
    return declared


def declaration(target) -> OpDeclaration | None:
    """The declaration of the op ``target`` (by overload, else by packet), if any."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    packet = f"{target.namespace}::{target._opname}"
    return _DECLARED.get(f"{packet}.{target._overloadname}") or _DECLARED.get(packet)


def declares_output_dtype(target) -> bool:
    """``target`` has a declared argument that sets its output dtype."""
    found = declaration(target)
    return found is not None and found.output_dtype is not None


def declared_ops() -> dict[str, OpDeclaration]:
    """Every declaration, by op name (for the documentation page and the report)."""
    return dict(_DECLARED)


def _name(op) -> str:
    if isinstance(op, str):
        if "::" not in op:
            raise InvalidOptionError(
                f"declare_op: an op name is 'namespace::op' or 'namespace::op.overload', got {op!r}"
            )
        return op
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}::{op._opname}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    raise InvalidOptionError(f"declare_op takes an op or its name, got {type(op).__name__}")


def _registered_overloads(name: str) -> list:
    """The overloads ``name`` stands for where torch has them registered, else []."""
    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), packet_name)
    except (AttributeError, RuntimeError):
        return []
    names = [overload] if overload else packet.overloads()
    return [getattr(packet, found) for found in names if found in packet.overloads()]
