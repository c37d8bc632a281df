"""The options of the fp32 -> fp16 cast, in one dataclass.

``fx16.cast_fp32_to_fp16``, ``fx16.cast_to_16_bit_precision``, ``fx16.fp16_passes``
and the accuracy budget's search take the same options; each reads them from
``Fp16Options`` (built from keywords with ``Fp16Options.of``), so an option is
declared, defaulted and checked for unknown names once. What each option means is
documented on ``fx16.cast_fp32_to_fp16``.
"""

from collections.abc import Collection
from dataclasses import dataclass, fields, replace
from typing import Any

from fx16.errors import InvalidOptionError


@dataclass(frozen=True)
class Fp16Options:
    policy: Any = None  # a PrecisionPolicy, a preset name, or None (the default policy)
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
