"""fx16: rewrite torch.export programs to 16-bit precision with composable FX passes."""

from fx16.casting import cast_fp32_to_fp16
from fx16.errors import Fx16Error, InvalidProgramError, PassFailedError, PreconditionError
from fx16.pipelines import fp16_passes

__all__ = [
    "Fx16Error",
    "InvalidProgramError",
    "PassFailedError",
    "PreconditionError",
    "cast_fp32_to_fp16",
    "fp16_passes",
]
