"""The rules of ``StabilizePass``: each matches one pattern 16-bit spoils and builds an
equivalent that computes well in it (its docstring shows before and after; ``marks``:
the meta markers its replacement writes). One family per module: the norms, the
magnitude, the logarithms and exponentials, GELU; what they share in ``matching``."""

from fx16.passes.stable_rewrites.gelu import TanhGelu
from fx16.passes.stable_rewrites.logs import Expm1, Log1p, LogSigmoid, LogSoftmax
from fx16.passes.stable_rewrites.magnitude import MagnitudeScaling
from fx16.passes.stable_rewrites.matching import Rewrite
from fx16.passes.stable_rewrites.norms import EpsClamp, RmsNormScaling, TwoPassVariance

__all__ = [
    "EpsClamp",
    "Expm1",
    "Log1p",
    "LogSigmoid",
    "LogSoftmax",
    "MagnitudeScaling",
    "Rewrite",
    "RmsNormScaling",
    "TanhGelu",
    "TwoPassVariance",
]
