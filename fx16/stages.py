"""The fp32 -> fp16 pipeline's stages by name, so that a caller (the accuracy search, a
test, a user's own pipeline) looks a stage up by what it does rather than by position."""

from dataclasses import dataclass, field, fields

from torch.fx.passes.infra.pass_base import PassBase


@dataclass
class Fp16Stages:
    """The passes of each stage, in pipeline order.

    ``prepare``: the program made ready before anything is measured (its stats recorded,
    a bf16 program widened, the model's aliased conversions pinned, the stable rewrites);
    ``calibrate``: the calibration run and the scale domains it plans and applies;
    ``analyze``: the analyses that read the program and write meta only;
    ``decide``: the safety rules and the check of their verdicts;
    ``convert``: the state tensors and user inputs converted;
    ``insert``: the cast inserter and what follows from its casts (storage as read, the
    bf16 range fallback, casts after writes);
    ``cleanup``: the cleanup rules and the scalars made constants.

    The first three find what does not depend on the fp32 set (the accuracy search runs
    them once: ``before_decisions``); the rest decide and rewrite (``from_decisions``).
    """

    prepare: list[PassBase] = field(default_factory=list)
    calibrate: list[PassBase] = field(default_factory=list)
    analyze: list[PassBase] = field(default_factory=list)
    decide: list[PassBase] = field(default_factory=list)
    convert: list[PassBase] = field(default_factory=list)
    insert: list[PassBase] = field(default_factory=list)
    cleanup: list[PassBase] = field(default_factory=list)

    @property
    def before_decisions(self) -> list[PassBase]:
        return [*self.prepare, *self.calibrate, *self.analyze]

    @property
    def from_decisions(self) -> list[PassBase]:
        return [*self.decide, *self.convert, *self.insert, *self.cleanup]

    def passes(self) -> list[PassBase]:
        """Every pass, in pipeline order."""
        return [stage for name in self.names() for stage in getattr(self, name)]

    def find(self, kind: type) -> PassBase:
        """The one pass of type ``kind``; ``LookupError`` naming the stages if none."""
        for stage in self.passes():
            if isinstance(stage, kind):
                return stage
        raise LookupError(f"no {kind.__name__} among the stages {', '.join(self.names())}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
