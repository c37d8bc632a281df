"""Op tables: which ATen overloads fx16 treats specially.

Every op list the passes use lives here, so a pipeline that wants different
behaviour changes data, not pass code. Overloads missing from the installed
torch are skipped, so the tables work across the supported torch versions.
"""

import torch

aten = torch.ops.aten


def _overloads(*names: str) -> frozenset:
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
CAST_OPS = _overloads("_to_copy.default", "to.dtype", "to.dtype_layout")

# Ops that make a new floating tensor from sizes and scalars (or from another
# tensor's shape): their precision is set by a ``dtype`` argument, not by inputs.
CREATION_OPS = _overloads(
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
ASSERT_METADATA_OPS = _overloads("_assert_tensor_metadata.default")
