"""The caller's choices, and how each stage reads them: ``PrecisionPolicy`` (here),
``Precision`` and the policy's tables (``fx16.policy.precision``), the cast's options
(``fx16.policy.options``). The names of the settings, which the command line lists
without importing torch, are ``fx16.choices``.

PrecisionPolicy: which precision each op asks for, as data.

A policy maps every node to a ``Precision``. The most specific rule wins: a node
name, then the predicate, then the longest matching module path (from
``nn_module_stack``; for parameters, their own dotted name), then the ATen op, then
the op's table entry (the autocast presets), then its kind. The safety rules come
after the policy and always win: a value that overflows the 16-bit dtype, an
explicit fp32 region the model wrote, a float that decides an index, an integer
range that does not fit - those stay wide whatever the policy says.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace

import torch
from torch.fx import Node

from fx16.choices import (
    EXPLICIT_FP32_CHOICES,
    POLICY_PRESETS,
    RANGE_FALLBACK_CHOICES,
    ROUTING_CHOICES,
    TARGETS,
)
from fx16.errors import InvalidOptionError, require_choice, require_number
from fx16.ops.autocast import AUTOCAST_CPU, AUTOCAST_CUDA
from fx16.ops.kinds import OpKind, op_kind, op_name
from fx16.policy.precision import ALL_LOW, Precision, as_precision, op_kind_key, precisions
from fx16.program.nodes import SIXTEEN_BIT_DTYPES, node_module_path


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which precision each node asks for. Build one with a preset or ``custom``.

    low: the 16-bit dtype, torch.float16 or torch.bfloat16.
    kinds / ops / modules / nodes: overrides by op kind, by ATen op name ("softmax"),
        by module path prefix ("model.layers.0.mlp"), by node name; values are
        Precision members or "fp16"/"bf16"/"16-bit"/"fp32"/"follow"/"promote".
    predicate: a function node -> Precision (or None to defer), checked after names.
    keep_io_types: keep user inputs and outputs at their original dtype (casts at the
        boundary); True for all, or a collection of input/output node names.
    explicit_fp32: what becomes of the fp32 regions the model opens itself
        (``x.float()`` before a variance, ``softmax(dtype=torch.float32)``), when a
        precision-sensitive op follows (``fx16.analysis.explicit_fp32``): "keep" (the
        default) keeps them all, as ``.half()`` and eager autocast do, and the stable
        rewrites leave the patterns in them alone; in a region retargeted to 16-bit an
        RMSNorm is computed as its fp32 form is, rounded once
        (``fx16.passes.stable_rewrites.norm_statistic``); "calibrated" keeps one only on
        evidence that 16-bit would spoil it (a value in it beyond the 16-bit range or below
        its normal range on the calibration inputs, with the margin; an ill-conditioned op
        in it; a proven range; or no calibration input reaching it), for targets where each
        fp32 op is costly (the Neural Engine); "retarget" casts them all to
        16-bit as coreai-opt does (the safety rules still apply op by op).
    routing: where the ops that choose a route compute - a mixture-of-experts router
        (the gate's product, its softmax, the top-k), a greedy decoder's argmax: "fp32"
        keeps the selection and the ops between it and the product that scores the
        choices in fp32, and that product too where it costs at most 1% of the
        program's product FLOPs (a router's gate, not a decoder's vocabulary head);
        nothing upstream (``fx16.analysis.routing``). "16-bit" casts them like the rest.
        Either way every index chosen is valid; precision only changes which.
    cast_back: return results computed in fp32 by policy to the 16-bit dtype (False:
        later ops follow the fp32 result, as eager autocast does).
    widen_model_16bit: an op the policy puts in fp32 computes in fp32 even where the
        model made its inputs 16-bit itself (``x.to(torch.bfloat16)`` then ``mse_loss``),
        as eager autocast's fp32 list does; off, such an op is left as the model
        computes it. On in the ``autocast`` preset.
    stabilize: rewrite patterns that 16-bit spoils into forms that are exact in real
        arithmetic and stable in 16-bit before casting (``fx16.passes.stabilize``:
        RMSNorm's variance scaled by the row's largest magnitude, log(softmax) as
        log_softmax, log(1 + x) as log1p, ...), so that they need no fp32 and hold on
        inputs the calibration never showed. On by default (off in the ``autocast``
        preset, which gives each op what eager autocast gives it).
    eps_clamp: raise an ``eps`` below the 16-bit dtype's smallest normal to it
        (``rsqrt(v + 1e-12)``): unlike the ``stabilize`` rewrites this changes the result
        where the sum is below the new eps, so it is off unless asked for.
    scale_range: carry fp16 values beyond its range at power-of-two scales folded into
        weights and constants (``fx16.analysis.scale_domains``) rather than in fp32. On
        by default for fp16 (bf16 has fp32's range); off in the ``autocast`` preset.
    range_fallback: where an fp16 program computes the values kept out of fp16 for range
        alone, beyond its range or below its normal range where no power-of-two scale
        carries them (logits a softmax needs unscaled), and the ops that read only such
        values: "fp32" (the default) or "bf16", which has fp32's exponent range at 8
        significant bits, for targets that compute in both 16-bit dtypes
        (``fx16.passes.RangeFallbackPass``). Without effect on a bf16 policy.
    precision_tolerance: the relative output error 16-bit rounding of an op's input
        may cause through the op's condition number before the op stays fp32
        (``fx16.analysis.conditioning``); None: two roundings of ``low`` (its eps:
        about 1e-3 for fp16, 7.8e-3 for bf16); ``math.inf`` turns the rule off.
    """

    name: str = "default"
    low: torch.dtype = torch.float16
    kinds: Mapping[OpKind, Precision] = field(default_factory=lambda: dict(ALL_LOW))
    ops: Mapping[str, Precision] = field(default_factory=dict)
    modules: Mapping[str, Precision] = field(default_factory=dict)
    nodes: Mapping[str, Precision] = field(default_factory=dict)
    predicate: Callable[[Node], Precision | None] | None = None
    op_table: Mapping[str, Precision] = field(default_factory=dict)
    keep_io_types: bool | frozenset[str] = False
    explicit_fp32: str = "keep"
    routing: str = "fp32"
    cast_back: bool = True
    widen_model_16bit: bool = False
    precision_tolerance: float | None = None
    stabilize: bool = True
    eps_clamp: bool = False
    scale_range: bool = True
    range_fallback: str = "fp32"

    def __post_init__(self) -> None:
        if self.low not in SIXTEEN_BIT_DTYPES:
            raise InvalidOptionError(f"low must be torch.float16 or torch.bfloat16, not {self.low}")
        kinds = {op_kind_key(key): value for key, value in precisions(self.kinds).items()}
        object.__setattr__(self, "kinds", {**ALL_LOW, **kinds})
        object.__setattr__(self, "_by_op", {})  # precision_for's answers, by op
        for name in ("ops", "modules", "nodes", "op_table"):
            object.__setattr__(self, name, precisions(getattr(self, name)))
        if not isinstance(self.keep_io_types, bool):
            object.__setattr__(self, "keep_io_types", as_names(self.keep_io_types))
        require_choice("explicit_fp32", self.explicit_fp32, EXPLICIT_FP32_CHOICES)
        require_choice("routing", self.routing, ROUTING_CHOICES)
        require_choice("range_fallback", self.range_fallback, RANGE_FALLBACK_CHOICES)
        if self.precision_tolerance is not None:
            require_number(
                "precision_tolerance",
                self.precision_tolerance,
                0,
                strict=True,
                finite=False,  # inf turns the rule off
                note=" (or None)",
            )

    # ---- presets -----------------------------------------------------------------------
    # Each takes overrides of any field: PrecisionPolicy.auto_mixed(keep_io_types=True).

    @classmethod
    def default(cls, **overrides) -> "PrecisionPolicy":
        """coreai-opt's behaviour, with fx16's safety rules: everything in fp16."""
        return cls._preset(overrides)

    @classmethod
    def always_fp32(cls, **overrides) -> "PrecisionPolicy":
        """Nothing changes."""
        return cls._preset(
            overrides, name="always_fp32", kinds={kind: Precision.FP32 for kind in OpKind}
        )

    @classmethod
    def always_fp16(cls, **overrides) -> "PrecisionPolicy":
        """Every op in fp16, the model's own fp32 casts included (safety rules still apply)."""
        return cls._preset(overrides, name="always_fp16", explicit_fp32="retarget")

    @classmethod
    def auto_mixed_conservative(cls, **overrides) -> "PrecisionPolicy":
        """Reductions (softmax, norms, sums, cumsum, losses) in fp32, cast back after;
        the model's own fp32 regions kept."""
        return cls._preset(
            overrides,
            name="auto_mixed_conservative",
            kinds={**ALL_LOW, OpKind.REDUCTION: Precision.FP32},
            explicit_fp32="keep",
        )

    @classmethod
    def auto_mixed(cls, **overrides) -> "PrecisionPolicy":
        """Reductions in 16-bit too: their kernels accumulate in fp32 internally."""
        return cls._preset(overrides, name="auto_mixed")

    @classmethod
    def auto_mixed_bf16(cls, **overrides) -> "PrecisionPolicy":
        """auto_mixed in bf16: bf16 has fp32's range, so only fp32-range overflow matters."""
        return cls._preset(overrides, name="auto_mixed_bf16", low=torch.bfloat16)

    @classmethod
    def autocast(
        cls, device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16, **overrides
    ) -> "PrecisionPolicy":
        """A static torch.autocast: each op gets the dtype eager autocast gives it.

        Inputs and weights stay fp32; ops in autocast's lower-precision list run in
        ``dtype``, ops in its fp32 list in fp32, "promote" ops in their widest input
        dtype, and every other op follows its inputs. The conditioning rule is off
        (``precision_tolerance=inf``), so every op gets what eager autocast gives it,
        and the model's own fp32 regions stay fp32, as under eager autocast.
        Tables: ``fx16.ops.autocast.AUTOCAST_*``.
        """
        tables = {"cpu": AUTOCAST_CPU, "cuda": AUTOCAST_CUDA}
        if device_type not in tables:
            raise InvalidOptionError(f"autocast device_type must be one of {sorted(tables)}")
        table = tables[device_type]
        op_table = {
            **dict.fromkeys(table["lower_precision_fp"], Precision.LOW),
            **dict.fromkeys(table["fp32"], Precision.FP32),
            **dict.fromkeys(table["promote"], Precision.PROMOTE),
        }
        kinds = {kind: Precision.FOLLOW for kind in OpKind} | {OpKind.BOUNDARY: Precision.FP32}
        return cls._preset(
            overrides,
            name=f"autocast({device_type}, {str(dtype).removeprefix('torch.')})",
            low=dtype,
            kinds=kinds,
            op_table=op_table,
            cast_back=False,
            widen_model_16bit=True,  # fp32-list ops widen the model's own 16-bit inputs
            precision_tolerance=math.inf,  # eager autocast's dtypes, op by op
            explicit_fp32="keep",
            stabilize=False,  # eager autocast's ops, not rewritten ones
            scale_range=False,  # nor rescaled ones
        )

    @classmethod
    def custom(cls, base: "PrecisionPolicy | None" = None, **changes) -> "PrecisionPolicy":
        """A policy from ``base`` (default: ``default()``) with ``changes`` to its fields."""
        _check_fields(changes)
        return replace(base or cls.default(), name=changes.pop("name", "custom"), **changes)

    @classmethod
    def _preset(cls, overrides: dict, **fields) -> "PrecisionPolicy":
        """The preset made of ``fields``, with the caller's ``overrides`` on top."""
        _check_fields(overrides)
        return cls(**{**fields, **overrides})

    @classmethod
    def named(cls, name: str) -> "PrecisionPolicy":
        """A preset by name ("auto_mixed_bf16", "autocast" = autocast("cpu", bf16), ...)."""
        if name not in POLICY_PRESETS:
            raise InvalidOptionError(
                f"unknown policy {name!r}; presets: {', '.join(POLICY_PRESETS)}"
            )
        return getattr(cls, name)()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_by_op"}  # ops hold C state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _by_op={})

    # ---- questions ---------------------------------------------------------------------

    @property
    def resolved_precision_tolerance(self) -> float:
        """``precision_tolerance``, or two roundings of the 16-bit dtype (its eps): the
        input of an ill-conditioned op has been rounded more than once on its way."""
        if self.precision_tolerance is not None:
            return float(self.precision_tolerance)
        return torch.finfo(self.low).eps

    @property
    def is_noop(self) -> bool:
        return all(self.kinds[kind] == Precision.FP32 for kind in OpKind) and not (
            self.ops or self.modules or self.nodes or self.predicate or self.op_table
        )

    def precision_for(self, node: Node, module_path: str | None = None) -> Precision:
        """The precision ``node`` asks for (``module_path``: a parameter's dotted name).
        Where only op names and kinds decide (no node, predicate or module entries), an
        op's answer is found once and kept for its other nodes."""
        if self.nodes or self.predicate is not None or self.modules:
            return self.matching_entry(node, module_path)[0]
        if node.op != "call_function":  # no op name for an entry to match: its kind decides
            return self.kinds[op_kind(node)]
        target = node.target
        found = self._by_op.get(id(target))
        if found is None or found[0] is not target:  # held: the id stays the op's
            found = self._by_op[id(target)] = (target, self.matching_entry(node)[0])
        return found[1]

    def matching_entry(self, node: Node, module_path: str | None = None) -> tuple[Precision, str]:
        """The precision ``node`` asks for, and the entry of the policy that says so
        ("modules['model.layers.0'] = fp32", "kinds[reduction] = fp32")."""
        if node.name in self.nodes:
            return self.nodes[node.name], _entry("nodes", node.name, self.nodes[node.name])
        if self.predicate is not None:
            decided = self.predicate(node)
            if decided is not None:
                precision = as_precision(decided)
                return precision, f"predicate = {precision.value}"
        path = (module_path or node_module_path(node)) if self.modules else None
        if path is not None:
            matches = [p for p in self.modules if path == p or path.startswith(p + ".")]
            if matches:
                longest = max(matches, key=len)
                return self.modules[longest], _entry("modules", longest, self.modules[longest])
        name = op_name(node)
        overload = getattr(node.target, "_overloadname", None) if name is not None else None
        for table, entries in (("ops", self.ops), ("op_table", self.op_table)):
            for key in (f"{name}.{overload}", name):  # "_convolution.deprecated", "_convolution"
                if key in entries:
                    return entries[key], _entry(table, key, entries[key])
        kind = op_kind(node)
        return self.kinds[kind], f"kinds[{kind.value}] = {self.kinds[kind].value}"

    def keeps_io(self, name: str) -> bool:
        return self.keep_io_types is True or (
            isinstance(self.keep_io_types, frozenset) and name in self.keep_io_types
        )


def as_names(value) -> frozenset:
    """Names given as one name (a str or an output position) or a collection of them."""
    return frozenset([value] if isinstance(value, (str, int)) else value)


def _entry(table: str, key: str, precision: Precision) -> str:
    return f"{table}[{key!r}] = {precision.value}"


def _check_fields(changes: dict) -> None:
    unknown = sorted(set(changes) - {f.name for f in fields(PrecisionPolicy)})
    if unknown:
        accepted = ", ".join(f.name for f in fields(PrecisionPolicy))
        raise InvalidOptionError(f"unknown policy field(s) {unknown}; fields: {accepted}")


def resolve_policy(
    policy: PrecisionPolicy | str | None, target: str | None = None, **overrides
) -> PrecisionPolicy:
    """The policy to use: a preset by name, the given one, or the default; with the
    settings of ``target`` (``fx16.choices.TARGETS``), then the ``overrides`` of its
    fields (``explicit_fp32``, ``keep_io_types``) that are not None."""
    if policy is None:
        policy = PrecisionPolicy.default()
    elif isinstance(policy, str):
        policy = PrecisionPolicy.named(policy)
    elif not isinstance(policy, PrecisionPolicy):
        raise InvalidOptionError(
            f"policy must be a PrecisionPolicy or a preset name, not {type(policy).__name__}"
        )
    overrides = {name: value for name, value in overrides.items() if value is not None}
    if target is not None:
        require_choice("target", target, tuple(TARGETS))
        overrides = {**TARGETS[target], **overrides}
    return replace(policy, **overrides) if overrides else policy
