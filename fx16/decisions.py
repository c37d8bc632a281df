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
    ACCUMULATING_STATE = (
        "a state tensor the program writes from its own value each call: it grows with "
        "the number of calls"
    )
    ACTIVATION_BELOW_RANGE = (
        "its values lie below the 16-bit normal range on the calibration inputs: subnormal "
        "or zero in 16-bit"
    )
    FP32_INPUT = "an input stays fp32"
    BF16_INPUT = "an input is computed in bf16 for range"
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
    IGNORED_OP = "the caller's ignored_ops names it"
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
        return self.dtype in _NARROW_DTYPES

    def said(self) -> str:
        """The rule and the evidence, as text: "activation_overflow: observed 7e+04"."""
        return self.reason.name.lower() + (f": {self.detail}" if self.detail else "")


_NARROW_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.int16})


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


# ---- what each reason means to the stages that read it -----------------------------------


@dataclass(frozen=True)
class ReasonSpec:
    """How the stages treat a value decided for a reason, declared once per reason.

    ``family``: what kind of cause it is - "fits" (16-bit), "range" (beyond 16-bit's
    range or below its normal range: bf16's range holds it, ``range_fallback``),
    "safety" (a kernel or an op's contract), "precision" (16-bit rounding would spoil
    it), "model" (the model's own dtypes), "storage" (where a tensor is stored),
    "choice" (the caller's or the policy's), "follows" (an input's decision), "integer".
    ``downcastable``: an fp32 value so decided that fits 16-bit may be read by a 16-bit
    op through a cast, as eager autocast casts weights (``fx16.plan.view.View``).
    ``checked``: VerdictCheckAnalysis measures whether keeping it fp32 pays for its FLOPs.
    ``never_int16``: an integer so decided was never a candidate for int16 (outside the
    castable set), so the report's explained rows leave it out.
    ``follows_bf16``: ``range_fallback="bf16"`` moves a value so decided to bf16 with the
    range values it reads (an op reading them, a state tensor only they read);
    ``bf16_fallback``, the property: that, or a range cause itself. The report explains
    a bf16 value of an fp16 cast decided for such a reason.
    ``cause`` and ``instead``: its row in the "what stays fp32" tables of the README and
    the docs (written from these specs: ``python docs/hooks/generated_pages.py``);
    reasons with the same cause share a row, and one without a cause has none.
    """

    family: str
    downcastable: bool = False
    checked: bool = False
    never_int16: bool = False
    follows_bf16: bool = False
    cause: str = ""
    instead: str = "-"

    @property
    def bf16_fallback(self) -> bool:
        return self.family == "range" or self.follows_bf16


_BELOW_RANGE = (
    "a weight, or a value on the calibration inputs, wholly below 16-bit's normal range "
    "(subnormal or zero in 16-bit)"
)

FAMILIES = ("fits", "range", "safety", "precision", "model", "storage", "choice", "follows")

REASON_SPECS: dict[Reason, ReasonSpec] = {
    Reason.FITS: ReasonSpec("fits"),
    Reason.VALUE_OVERFLOW: ReasonSpec("range"),
    Reason.SCALAR_OVERFLOW: ReasonSpec("range"),
    Reason.ACTIVATION_OVERFLOW: ReasonSpec(
        "range",
        checked=True,
        cause=(
            "activations beyond 16-bit's range on the calibration inputs, with a 2x margin, "
            "where no power-of-two scale can carry them"
        ),
        instead=(
            "a scale domain (below), else a cast-back to 16-bit where the consumers' values fit"
        ),
    ),
    Reason.VALUE_BELOW_RANGE: ReasonSpec(
        "range",
        cause=_BELOW_RANGE,
    ),
    Reason.ACTIVATION_BELOW_RANGE: ReasonSpec(
        "range",
        cause=_BELOW_RANGE,
    ),
    Reason.UNDERFLOW: ReasonSpec(
        "range",
        downcastable=True,
        cause="a value that would flush to zero where an op is singular (log, reciprocal, rsqrt)",
        instead="a stable rewrite (`log_sigmoid`, RMSNorm's scaling), on by default",
    ),
    Reason.ACCUMULATING_STATE: ReasonSpec(
        "precision",
        cause=(
            "a buffer the program accumulates into across calls (a running total): in "
            "16-bit an update below 2**-11 of the total rounds away"
        ),
        instead="the update computes in 16-bit where it fits; only the running state is fp32",
    ),
    Reason.FP32_INPUT: ReasonSpec("follows"),
    Reason.BF16_INPUT: ReasonSpec("follows", follows_bf16=True),
    Reason.EXPLICIT_FP32: ReasonSpec(
        "model",
        checked=True,
        cause="the model's own `torch.autocast(enabled=False)` or fp32 region",
        instead=(
            'kept as the model wrote it, as `.half()` does; with `explicit_fp32="calibrated"` '
            "(for the Neural Engine) retargeted to 16-bit where calibration shows it fits"
        ),
    ),
    Reason.EXPLICIT_FP32_RETARGETED: ReasonSpec("fits"),
    Reason.MIXED_FLOAT_DTYPES: ReasonSpec("model"),
    Reason.NO_FLOAT_INPUT: ReasonSpec("model"),
    Reason.NO_FAKE_KERNEL: ReasonSpec(
        "safety",
        cause="a custom op whose fake kernel refuses 16-bit inputs (or that has none)",
        instead="it reads its inputs cast up; its result is cast back",
    ),
    Reason.NO_LOW_KERNEL: ReasonSpec(
        "safety",
        downcastable=True,
        cause=(
            "an op with no 16-bit kernel (FFTs, factorizations, special functions), as eager "
            "autocast keeps them"
        ),
        instead="its readers take a 16-bit copy of its result",
    ),
    Reason.FIXED_OUTPUT_DTYPE: ReasonSpec("safety", downcastable=True),
    Reason.SUBCLASS_KEPT: ReasonSpec("safety"),
    Reason.SHARED_FP32: ReasonSpec("storage"),
    Reason.READERS_FP32: ReasonSpec("storage", downcastable=True, follows_bf16=True),
    Reason.OPAQUE_SUBGRAPH: ReasonSpec("model"),
    Reason.LOOP_CARRIED: ReasonSpec("model", downcastable=True),
    Reason.AUTOCAST_DISABLED: ReasonSpec("model"),
    Reason.AUTOCAST_REGION: ReasonSpec("model"),
    Reason.ILL_CONDITIONED: ReasonSpec(
        "precision",
        downcastable=True,
        checked=True,
        cause=(
            "a subtraction or normalization that cancels (per slice: one narrow column is "
            "judged apart)"
        ),
        instead="the short elementwise chain only; products stay 16-bit",
    ),
    Reason.SCALAR_CLAMPED: ReasonSpec("fits"),
    Reason.ROUTER: ReasonSpec(
        "precision",
        cause=(
            "a router's choice (an MoE gate's top-k, a greedy decoder's argmax), with "
            '`routing="fp32"` (the default)'
        ),
        instead='`routing="16-bit"`; every index chosen is valid either way',
    ),
    Reason.NOT_WORTH_FP32: ReasonSpec("fits"),
    Reason.ACCURACY_FALLBACK: ReasonSpec(
        "choice",
        downcastable=True,
        cause="an accuracy budget (`max_rel_error=`) not met",
        instead="the cheapest remedies first: rewrites, elementwise ops, then products",
    ),
    Reason.FORCED: ReasonSpec(
        "choice",
        downcastable=True,
        cause="the caller's `force_fp32=[...]` names it",
    ),
    Reason.IGNORED_OP: ReasonSpec(
        "choice",
        downcastable=True,
        cause="an op the caller's `ignored_ops` names (coreai-opt's option)",
    ),
    Reason.POLICY: ReasonSpec("choice", downcastable=True),
    Reason.POLICY_FOLLOW: ReasonSpec("choice", downcastable=True),
    Reason.KEEP_IO: ReasonSpec("choice"),
    Reason.NOT_USER_REACHABLE: ReasonSpec("integer", never_int16=True),
    Reason.UNSAFE_INDEX: ReasonSpec(  # floats and integers
        "safety",
        downcastable=True,
        never_int16=True,
        cause="a float value that decides an index (bucket ids, positions)",
    ),
    Reason.SCALAR_OPERAND: ReasonSpec("integer"),
    Reason.NOT_CASTABLE: ReasonSpec("integer", never_int16=True),
    Reason.RANGE_UNKNOWN: ReasonSpec("integer"),
    Reason.RANGE_EXCEEDS: ReasonSpec("integer"),
    Reason.NOT_INT16_OP: ReasonSpec("integer"),
    Reason.NO_INT16_CONSUMER: ReasonSpec("integer"),
    Reason.IN_PLACE: ReasonSpec("integer"),
    Reason.ASSUMED_SAFE: ReasonSpec("integer"),
}


def reasons(*, family: str | None = None, **flags: bool) -> frozenset[Reason]:
    """The reasons whose spec has the given ``family`` and flags (``downcastable``,
    ``checked``, ``never_int16``, ``bf16_fallback``; one not given: any)."""
    wanted = {"family": family, **flags}
    unknown = set(flags) - {"downcastable", "checked", "never_int16", "bf16_fallback"}
    if unknown:
        raise TypeError(f"reasons() got flags no ReasonSpec has: {sorted(unknown)}")
    return frozenset(
        reason
        for reason, spec in REASON_SPECS.items()
        if all(value is None or getattr(spec, name) == value for name, value in wanted.items())
    )


def _check_specs() -> None:
    """Every reason has a spec, of a known family: a reason added without one would be
    treated as nothing at all by every stage that reads the specs."""
    missing = [reason.name for reason in Reason if reason not in REASON_SPECS]
    unknown = [r.name for r, s in REASON_SPECS.items() if s.family not in (*FAMILIES, "integer")]
    if missing or unknown:
        raise AssertionError(f"reasons without a spec: {missing}; of no known family: {unknown}")


_check_specs()
