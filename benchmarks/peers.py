"""The fp32 -> fp16 casts the benchmarks compare: fx16's, and the peers installed here."""

import fx16


def fp16_casts() -> dict:
    """name -> function(ep) casting in place: fx16 (default, uncalibrated), coreai-opt 0.3.0."""
    casts = {
        "fx16": fx16.cast_fp32_to_fp16,
        "fx16, calibration=[]": lambda ep: fx16.cast_fp32_to_fp16(ep, calibration=[]),
    }
    try:
        from coreai_opt.casting import cast_fp32_to_fp16
    except ImportError:
        return casts
    casts["coreai-opt 0.3.0"] = cast_fp32_to_fp16
    return casts
