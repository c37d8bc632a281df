"""The options of the fp32 -> fp16 cast, in one dataclass.

``fx16.cast_fp32_to_fp16``, ``fx16.cast_to_16_bit_precision``, ``fx16.fp16_passes``
and the accuracy budget's search take the same options; each reads them from
``Fp16Options`` (built from keywords with ``Fp16Options.of``), so an option is
declared, defaulted and checked for unknown names once. What each option means is
documented on ``fx16.cast_fp32_to_fp16``.
"""

from collections.abc import Callable, Collection
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from fx16.errors import InvalidOptionError


@dataclass(frozen=True)
class Fp16Options:
    policy: Any = None  # a PrecisionPolicy, a preset name, or None (the default policy)
    target: str | None = None  # a deployment target (fx16.choices.TARGETS): its settings
    explicit_fp32: str | None = None
    stabilize: bool | None = None  # None: the policy's setting
    eps_clamp: bool | None = None  # None: the policy's setting
    routing: str | None = None  # None: the policy's setting
    range_fallback: str | None = None  # None: the policy's setting
    keep_io_types: bool | Collection[str] | None = None
    calibration: list | None = None
    overflow_margin: float = 2.0
    input_ranges: dict | None = None
    force_fp32: Collection[str] | str = frozenset()
    ignored_ops: Any = None  # coreai-opt's: ops, a collection of them, or a node predicate
    scalars: str = "exact"  # which Python numbers become 16-bit constants
    # the nodes an accuracy-budget search returned to fp32 (set by the search, not by
    # callers: their own names go in force_fp32, and the report tells the two apart)
    fallback: frozenset[str] = frozenset()

    @classmethod
    def names(cls) -> frozenset[str]:
        """The options a caller passes (``fallback`` is the accuracy search's own)."""
        return frozenset(field.name for field in fields(cls)) - {"fallback"}

    @classmethod
    def of(
        cls, where: str, options: "Fp16Options | None" = None, also=(), **keywords
    ) -> "Fp16Options":
        """``options`` (default: all defaults) with ``keywords`` replacing its fields;
        ``InvalidOptionError`` naming ``where`` for a keyword that is not an option
        (the accepted ones listed, with the caller's own keywords ``also``)."""
        unknown = sorted(set(keywords) - cls.names())
        if unknown:
            accepted = sorted(cls.names() | set(also))
            raise InvalidOptionError(f"{where}: unknown option(s) {unknown}; accepted: {accepted}")
        if options is not None and not isinstance(options, Fp16Options):
            raise InvalidOptionError(
                f"{where}: options must be an fx16.Fp16Options, not {type(options).__name__}"
            )
        return replace(options or cls(), **keywords)

    def as_keywords(self) -> dict:
        return {name: getattr(self, name) for name in sorted(self.names())}


_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


@dataclass(frozen=True)
class IgnoredOps:
    """coreai-opt's ``ignored_ops``, as fx16 reads it: the ops (overloads, or packets for
    all their overloads) and the predicate on a ``torch.fx.Node`` whose nodes compute in
    fp32, with casts at their boundary."""

    ops: frozenset = frozenset()
    predicate: Callable | None = None

    @classmethod
    def of(cls, value) -> "IgnoredOps":
        """``value`` as coreai-opt takes it: None, one op, a collection of ops, or a
        predicate; ``InvalidOptionError`` for anything else, naming it."""
        if value is None or isinstance(value, IgnoredOps):
            return value or cls()
        if isinstance(value, _OPS):
            return cls(frozenset([value]))
        if callable(value):
            return cls(predicate=value)
        if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
            raise InvalidOptionError(_MALFORMED.format(value=value))
        wrong = [item for item in value if not isinstance(item, _OPS)]
        if wrong:
            raise InvalidOptionError(_MALFORMED.format(value=wrong[0]))
        return cls(frozenset(value))

    def names(self, node) -> str | None:
        """What names ``node`` (a call of an op this names, or one the predicate
        accepts), as the report says it; None where nothing does."""
        target = getattr(node, "target", None)
        if isinstance(target, torch._ops.OpOverload):
            for op in (target, target.overloadpacket):
                if op in self.ops:
                    return f"ignored_ops names {op}"
        if self.predicate is not None and node.op == "call_function" and self.predicate(node):
            name = getattr(self.predicate, "__qualname__", "the predicate")
            return f"ignored_ops's predicate {name} accepts {node.name}"
        return None

    def __repr__(self) -> str:
        named = sorted(map(str, self.ops))
        if self.predicate is not None:
            named.append(getattr(self.predicate, "__qualname__", "predicate"))
        return f"IgnoredOps({named})"

    def __bool__(self) -> bool:
        return bool(self.ops) or self.predicate is not None


_MALFORMED = (
    "ignored_ops takes an op (torch.ops.aten.exp or torch.ops.aten.exp.default), a "
    "collection of ops, or a function of a torch.fx.Node, as coreai-opt does; got {value!r}"
)
