"""fx16: rewrite torch.export programs to 16-bit precision with composable FX passes."""

from fx16.casting import cast_fp32_to_fp16, cast_int32_to_int16, cast_to_16_bit_precision
from fx16.errors import (
    AccuracyBudgetError,
    Fx16Error,
    InvalidOptionError,
    InvalidProgramError,
    PassFailedError,
    PreconditionError,
)
from fx16.pipelines import fp16_passes, int16_passes
from fx16.policy import OpKind, Precision, PrecisionPolicy

__all__ = [
    "AccuracyBudgetError",
    "Fx16Error",
    "InvalidOptionError",
    "InvalidProgramError",
    "OpKind",
    "PassFailedError",
    "Precision",
    "PrecisionPolicy",
    "PreconditionError",
    "cast_fp32_to_fp16",
    "cast_int32_to_int16",
    "cast_to_16_bit_precision",
    "fp16_passes",
    "int16_passes",
]
