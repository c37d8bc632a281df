"""What an accuracy-budget search did (``fx16.accuracy.budget``): the budget, the error it
reached on the calibration and validation inputs, and what that cost in fp32."""

from dataclasses import dataclass


@dataclass(frozen=True)
class AccuracySearch:
    """What the search did: the budget, the error reached, and what it cost."""

    budget: float
    error: float
    evaluations: int  # runs of the cast program over the calibration inputs
    rounds: int
    fp32_nodes: tuple[str, ...]
    flop_share_16bit: float = 1.0  # of matmul/conv/attention FLOPs, in the result
    target: float | None = None  # the calibration error the search aimed at
    plain_error: float | None = None  # the plain cast's, before any node returned to fp32
    metric: str = "rel"  # the metric the errors are in (fx16.accuracy.metrics)
    validation_error: float | None = None  # on the validation inputs, which the search never saw

    @property
    def met(self) -> bool:
        return self.error <= self.budget

    @property
    def validation_met(self) -> bool | None:
        """The validation error is within the budget (None: no validation inputs)."""
        return None if self.validation_error is None else self.validation_error <= self.budget

    @property
    def plain_kept(self) -> bool:
        """The plain cast met its target: no node returned to fp32."""
        return not self.rounds and not self.fp32_nodes

    def describe(self) -> str:
        """One line: the error reached (and on validation), the budget and target, and
        what it cost."""
        aim = f"budget {self.budget:.3g}"
        if self.target is not None and self.target != self.budget:
            aim += f", target {self.target:.3g}"
        metric = "" if self.metric == "rel" else f"{self.metric} "
        validation = ""
        if self.validation_error is not None:
            verdict = "within" if self.validation_met else "OVER"
            validation = (
                f"; {self.validation_error:.3g} on the validation inputs ({verdict} budget)"
            )
        if self.plain_kept:
            return (
                f"accuracy: {metric}error {self.error:.3g} on the calibration inputs ({aim}): "
                f"the plain cast meets it and is kept, nothing returned to fp32{validation}"
            )
        plain = f"; plain cast {self.plain_error:.3g}" if self.plain_error is not None else ""
        return (
            f"accuracy: {metric}error {self.error:.3g} on the calibration inputs ({aim}{plain}) "
            f"after {self.rounds} round(s), {self.evaluations} program evaluations, "
            f"{len(self.fp32_nodes)} node(s) back in fp32, {self.flop_share_16bit:.1%} of "
            f"matmul/conv/attention FLOPs in 16-bit{validation}"
        )
