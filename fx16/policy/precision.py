"""What a policy's tables hold: ``Precision`` values (from their names and aliases) and
op-kind keys, read and checked once when a ``PrecisionPolicy`` is made."""

import difflib
import enum
from collections.abc import Mapping

from fx16.choices import PRECISION_NAMES
from fx16.errors import InvalidOptionError
from fx16.ops.kinds import OpKind


class Precision(str, enum.Enum):
    LOW = "16-bit"  # the policy's 16-bit dtype (fp16 or bf16)
    FP32 = "fp32"
    FOLLOW = "follow"  # run in the dtype the inputs have (autocast: ops in no list)
    PROMOTE = "promote"  # cast float inputs to the widest of them, then follow


def as_precision(value) -> Precision:
    aliases = {"fp16": Precision.LOW, "bf16": Precision.LOW, "16": Precision.LOW}
    try:
        return aliases.get(value) or Precision(value)
    except ValueError:
        raise InvalidOptionError(
            f"unknown precision {value!r}; use one of {', '.join(PRECISION_NAMES)} (fp16 "
            "and bf16 name the policy's 16-bit dtype)"
        ) from None


def precisions(mapping: Mapping | None) -> dict:
    """Values as Precision; ATen op keys (torch.ops.aten.softmax.int) as their names."""
    return {
        getattr(key, "_opname", key): as_precision(value) for key, value in (mapping or {}).items()
    }


def op_kind_key(key) -> OpKind:
    """A ``kinds`` key as an OpKind: the member itself, its value ("reduction") or its
    name ("REDUCTION"), in any case. Anything else is refused with the closest kind."""
    if isinstance(key, OpKind):
        return key
    if isinstance(key, str):
        for kind in OpKind:
            if key.lower() in (kind.value, kind.name.lower()):
                return kind
    valid = [kind.value for kind in OpKind]
    close = difflib.get_close_matches(str(key).lower(), valid, 2)
    hint = f"closest: {', '.join(close)}" if close else f"kinds: {', '.join(valid)}"
    raise InvalidOptionError(f"kinds names no op kind: {key!r}; {hint}")


ALL_LOW = {kind: Precision.LOW for kind in OpKind}
