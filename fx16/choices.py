"""The named settings fx16 accepts, in a module that imports nothing heavy.

The command line builds its parser (and answers ``--help`` and ``--version``) from
these without importing torch; the modules that act on a setting check it against
the same tuples.
"""

# What becomes of the model's own fp32 regions (see PrecisionPolicy.explicit_fp32).
EXPLICIT_FP32_CHOICES = ("calibrated", "keep", "retarget")
# Where routers compute (see PrecisionPolicy.routing).
ROUTING_CHOICES = ("fp32", "16-bit")
# Where values whose range fp16 cannot carry compute (see PrecisionPolicy.range_fallback).
RANGE_FALLBACK_CHOICES = ("fp32", "bf16")
# What each deployment target pays for, as the PrecisionPolicy settings it sets unless the
# caller sets them (target=): the Neural Engine runs every fp32 op off the accelerator, so
# the model's own fp32 regions are kept only on evidence; a GPU computes in both 16-bit
# dtypes, so what no scale carries computes in bf16; a CPU pays little for fp32.
TARGETS = {
    "cpu": {"explicit_fp32": "keep", "range_fallback": "fp32"},
    "gpu": {"explicit_fp32": "keep", "range_fallback": "bf16"},
    "neural_engine": {"explicit_fp32": "calibrated", "range_fallback": "fp32"},
}
# The target cast_to_16_bit_precision, coreai-opt's entry point, takes when the caller names
# neither a target nor a policy: coreai-opt's users deploy to Core AI and the Neural Engine.
DROP_IN_TARGET = "neural_engine"
# Which Python numbers of 16-bit ops become 16-bit constants (ScalarsAsConstantsPass).
SCALARS_CHOICES = ("exact", "rounded", "keep")
# int16= modes: "proven" narrows only values whose proven or declared range fits;
# "observed" also trusts ranges seen on calibration inputs; "assume_safe" narrows the
# whole castable set unchecked, as coreai-opt does.
INT16_MODES = ("off", "proven", "observed", "assume_safe")
# The policy presets by name (PrecisionPolicy.named), with what each means.
POLICY_PRESETS = {
    "default": "everything 16-bit where safe",
    "always_fp32": "nothing changes",
    "always_fp16": "every op 16-bit, the model's own fp32 casts too",
    "auto_mixed": "everything 16-bit, reductions too",
    "auto_mixed_conservative": "reductions fp32",
    "auto_mixed_bf16": "auto_mixed in bfloat16",
    "autocast": 'torch.autocast("cpu", dtype=torch.bfloat16), op by op',
}
# Precisions a policy override may ask for (PrecisionPolicy's modules/ops/nodes values).
PRECISION_NAMES = ("16-bit", "fp16", "bf16", "fp32", "follow", "promote")
# Accuracy metrics the budget can measure in (fx16.accuracy.metrics has their definitions).
METRIC_PRESETS = ("rel", "cosine", "top1")
