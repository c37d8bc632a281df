"""The precision decisions fx16 records on the nodes it considers.

Transforms write ``node.meta[PRECISION]`` (floating point) or ``node.meta[INT_PRECISION]``
(integers) as ``Decision(dtype, reason, detail)``; the report and later runs read
them. A value counts as converted by fx16 when its decision is a 16-bit dtype:
only those are cast back again where an op must run wide.
"""

import enum
from dataclasses import dataclass

import torch
from torch.fx import Node

PRECISION = "fx16.precision"
INT_PRECISION = "fx16.int16"


class Reason(str, enum.Enum):
    FITS = "fits 16-bit"
    VALUE_OVERFLOW = "a tensor value exceeds the 16-bit range"
    SCALAR_OVERFLOW = "a scalar argument exceeds the 16-bit range"
    ACTIVATION_OVERFLOW = "its values exceed the 16-bit range on the calibration inputs"
    VALUE_BELOW_RANGE = (
        "every tensor value lies below the 16-bit normal range: subnormal or zero in 16-bit"
    )
    ACTIVATION_BELOW_RANGE = (
        "its values lie below the 16-bit normal range on the calibration inputs: subnormal "
        "or zero in 16-bit"
    )
    FP32_INPUT = "an input stays fp32"
    EXPLICIT_FP32 = "inside an fp32 region the model asks for explicitly"
    EXPLICIT_FP32_RETARGETED = (
        "the model's own fp32 cast, made 16-bit: nothing shows its region needs fp32"
    )
    MIXED_FLOAT_DTYPES = "mixes 16-bit values with another float dtype"
    NO_FLOAT_INPUT = "computed from non-float inputs"
    NO_FAKE_KERNEL = (
        "a custom op whose fake kernel does not take 16-bit inputs: they stay as exported"
    )
    NO_LOW_KERNEL = (
        "an op with no 16-bit kernel (an FFT, a factorization, a special function): fed "
        "16-bit values, the program would fail where fp32 runs"
    )
    FIXED_OUTPUT_DTYPE = "a custom op that returns fp32 whatever its inputs' dtype"
    SUBCLASS_KEPT = "a tensor subclass that cannot be rebuilt with 16-bit parts: left as it is"
    SHARED_FP32 = (
        "the same tensor is stored under another name that stays fp32: stored once, in "
        "fp32, and cast for the 16-bit ops that read it"
    )
    READERS_FP32 = (
        "every op that reads it computes in fp32: stored in fp32 rather than in 16-bit and "
        "cast up on every call"
    )
    OPAQUE_SUBGRAPH = "a higher-order op fx16 does not look inside runs as exported, in fp32"
    LOOP_CARRIED = "carried by a while_loop from one iteration to the next in its exported dtype"
    AUTOCAST_DISABLED = "inside a torch.autocast(enabled=False) region the model wrote"
    AUTOCAST_REGION = "inside a torch.autocast(enabled=True) region: follows its dtype"
    ILL_CONDITIONED = (
        "ill-conditioned: 16-bit rounding of its input, amplified by the op, exceeds the "
        "policy's precision tolerance (or it feeds such an op)"
    )
    UNDERFLOW = (
        "singular at zero, and its argument would be subnormal or zero in 16-bit (or it "
        "feeds such an op)"
    )
    SCALAR_CLAMPED = (
        "a nonzero scalar below 16-bit's smallest subnormal, clamped to it instead of "
        "flushing to zero"
    )
    ROUTER = (
        "chooses a route (an expert, a token) by comparing values: the policy's "
        "routing='fp32' keeps it in fp32"
    )
    NOT_WORTH_FP32 = (
        "a rule would keep it in fp32, but on the calibration inputs fp32 does not "
        "measurably lower the output error"
    )
    ACCURACY_FALLBACK = "returned to fp32 to meet the accuracy budget"
    FORCED = "the caller's force_fp32 names it"
    POLICY = "the precision policy asks for fp32"
    POLICY_FOLLOW = "follows its inputs' dtype (the policy's follow/promote rule)"
    KEEP_IO = "kept at its original dtype (keep_io_types)"
    # integers
    NOT_USER_REACHABLE = "does not depend on a user input (constant-foldable)"
    UNSAFE_INDEX = "flows into an index argument"
    SCALAR_OPERAND = "add/sub/mul with a scalar operand (the converter cannot run it in int16)"
    NOT_CASTABLE = "not connected to an integer add/sub/mul on tensors"
    RANGE_UNKNOWN = "its range, or an input's, is unknown"
    RANGE_EXCEEDS = "its range, or an input's, exceeds int16"
    NOT_INT16_OP = "the op does not compute in int16"
    NO_INT16_CONSUMER = "no consumer computes in int16"
    IN_PLACE = "writes a buffer (in place, or as the program's state update)"
    ASSUMED_SAFE = "narrowed without a range check (int16='assume_safe')"


@dataclass(frozen=True)
class Decision:
    dtype: torch.dtype
    reason: Reason
    detail: str = ""

    @property
    def narrowed(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16, torch.int16)

    def said(self) -> str:
        """The rule and the evidence, as text: "activation_overflow: observed 7e+04"."""
        return self.reason.name.lower() + (f": {self.detail}" if self.detail else "")


def decide(
    node: Node, dtype: torch.dtype, reason: Reason, *, key: str = PRECISION, detail: str = ""
) -> None:
    node.meta[key] = decision(dtype, reason, detail)


def decision(dtype: torch.dtype, reason: Reason, detail: str = "") -> Decision:
    """``Decision(dtype, reason, detail)``; one shared object per (dtype, reason) without
    a detail (decisions are immutable)."""
    if detail:
        return Decision(dtype, reason, detail)
    plain = _PLAIN.get((dtype, reason))
    if plain is None:
        plain = _PLAIN[(dtype, reason)] = Decision(dtype, reason)
    return plain


_PLAIN: dict[tuple[torch.dtype, Reason], Decision] = {}


def decision_of(node: Node, key: str = PRECISION) -> Decision | None:
    return node.meta.get(key)


def was_narrowed(node: Node, key: str = PRECISION) -> bool:
    decision = decision_of(node, key)
    return decision is not None and decision.narrowed
