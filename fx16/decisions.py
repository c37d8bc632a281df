"""The precision decision fx16 records on every node and state tensor it considers.

Transforms write ``node.meta[PRECISION] = Decision(dtype, reason)``; the report
and later passes read it. A value counts as converted by fx16 when its decision
says fp16 (or bf16): only those are upcast again where an op must run in fp32.
"""

import enum
from dataclasses import dataclass

import torch
from torch.fx import Node

PRECISION = "fx16.precision"


class Reason(str, enum.Enum):
    FITS = "fits 16-bit"
    VALUE_OVERFLOW = "a tensor value exceeds the 16-bit range"
    SCALAR_OVERFLOW = "a scalar argument exceeds the 16-bit range"
    ACTIVATION_OVERFLOW = "its values exceed the 16-bit range on the calibration inputs"
    FP32_INPUT = "an input stays fp32"
    EXPLICIT_FP32 = "inside an fp32 region the model asks for explicitly"
    MIXED_FLOAT_DTYPES = "mixes 16-bit values with another float dtype"
    NO_FLOAT_INPUT = "computed from non-float inputs"
    OPAQUE_SUBGRAPH = "a higher-order op whose body is not rewritten"


@dataclass(frozen=True)
class Decision:
    dtype: torch.dtype
    reason: Reason

    @property
    def narrowed(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16, torch.int16)


def decide(node: Node, dtype: torch.dtype, reason: Reason) -> None:
    node.meta[PRECISION] = Decision(dtype, reason)


def decision_of(node: Node) -> Decision | None:
    return node.meta.get(PRECISION)


def was_narrowed(node: Node) -> bool:
    decision = decision_of(node)
    return decision is not None and decision.narrowed
