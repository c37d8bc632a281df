"""fx16: rewrite torch.export programs to 16-bit precision with composable FX passes.

The public names load on first use (PEP 562), so that ``fx16 --help`` and
``fx16 --version`` answer without importing torch.
"""

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see of the names below, loaded lazily at run time
    from fx16.casting import (
        cast_fp32_to_fp16,
        cast_int32_to_int16,
        cast_to_16_bit_precision,
        inputs_for,
    )
    from fx16.diagnosis import diagnose
    from fx16.errors import (
        AccuracyBudgetError,
        Fx16Error,
        InvalidOptionError,
        InvalidProgramError,
        PassFailedError,
        PreconditionError,
    )
    from fx16.loading import load
    from fx16.ops.declarations import declare_op
    from fx16.ops.kinds import OpKind
    from fx16.pipelines import fp16_passes, int16_passes
    from fx16.policy import Precision, PrecisionPolicy
    from fx16.policy.options import Fp16Options

# Each public name, and the module that defines it.
_PUBLIC = {
    "AccuracyBudgetError": "fx16.errors",
    "Fp16Options": "fx16.policy.options",
    "Fx16Error": "fx16.errors",
    "InvalidOptionError": "fx16.errors",
    "InvalidProgramError": "fx16.errors",
    "OpKind": "fx16.ops.kinds",
    "PassFailedError": "fx16.errors",
    "Precision": "fx16.policy",
    "PrecisionPolicy": "fx16.policy",
    "PreconditionError": "fx16.errors",
    "cast_fp32_to_fp16": "fx16.casting",
    "cast_int32_to_int16": "fx16.casting",
    "cast_to_16_bit_precision": "fx16.casting",
    "declare_op": "fx16.ops.declarations",
    "diagnose": "fx16.diagnosis",
    "fp16_passes": "fx16.pipelines",
    "inputs_for": "fx16.casting",
    "int16_passes": "fx16.pipelines",
    "load": "fx16.loading",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """A public name, or a submodule (``fx16.report``) on first use."""
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    elif importlib.util.find_spec(f"fx16.{name}") is not None:
        value = importlib.import_module(f"fx16.{name}")
    else:
        raise AttributeError(f"module 'fx16' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
