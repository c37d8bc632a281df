"""The envelope of a cast: the inputs under which its decisions hold.

Some of fx16's decisions hold for every input: a stable rewrite is exact in real
arithmetic, an integer narrowed on a proven range stays in it, and a norm's statistic
kept fp32 because nothing bounds it below was kept whatever the inputs. The others
rest on what the calibration inputs showed, widened by the overflow margin: a value
judged to fit 16-bit because it stayed below 65504 / margin, an op singular at zero
left in 16-bit because the smallest value it read stayed in 16-bit's normal range.
``envelope(ep, margin)`` says how far inputs may move from the calibration inputs
before one of those observed decisions no longer holds: how much larger before a
16-bit value passes the 16-bit maximum, and how much quieter before a value a 16-bit
singular op reads leaves the normal range ("quiet inputs below this were never
observed"), and how coarsely 16-bit products round the logits an exponential reads (no
rule keeps a product fp32: sharper logits are named here, not held). The report prints
it (``CastReport.summary``), the JSON carries it.

Reads: the cast program's decisions and what calibration recorded on its nodes
(``meta["fx16.observed_range"]``, ``meta["fx16.observed_smallest"]``), the rewrites'
``meta["fx16.stabilized"]``, ``meta["fx16.bounded_below"]``, ``meta["fx16.scaled"]`` and
``meta["fx16.rounding_cancels"]``, proven ranges.
"""

import math
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.fx import Node

from fx16 import meta
from fx16.analysis.calibration import observed
from fx16.analysis.intervals import Source, ValueRange
from fx16.analysis.underflow import singular_argument, small_end
from fx16.decisions import PRECISION, Reason
from fx16.ops.kinds import (
    EXPONENTIAL_GROWTH_OPS,
    op_name,
)
from fx16.ops.numeric_tables import EXPONENTIAL_TAIL_OPS, SOFTMAX_OPS
from fx16.ops.numerics import largest, smallest_normal
from fx16.program.casts import is_cast
from fx16.program.cost import is_product
from fx16.program.nodes import node_val
from fx16.program.subgraphs import named_graph_modules, qualified_name
from fx16.report.degrees import input_degrees
from fx16.report.growth_bounds import growth_bounds

SIXTEEN_BIT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Envelope:
    """Where a cast's decisions hold (see the module). Factors are None where no
    observed decision limits them."""

    calibration: str  # how calibration went ("observed on 4 input(s)", "skipped: ...")
    margin: float  # the overflow margin the decisions were made with
    rewritten: int  # stable rewrites: exact for every input
    proven: int  # values narrowed on a proven range: in range for every input
    # the program's float inputs may grow this many times beyond the calibration inputs
    # before the tightest 16-bit value (headroom_node, which grows as the inputs to the
    # power headroom_degree: 2 for attention scores) passes the 16-bit maximum; None
    # where no 16-bit value grows with them (token ids in, weights only)
    headroom: float | None = None
    headroom_node: str = ""
    headroom_degree: float = 1.0
    # the smallest nonzero value a 16-bit op singular at zero read on calibration, and
    # how many times quieter inputs may make it before it leaves the normal range
    quietest: float | None = None
    quietest_node: str = ""
    quiet_factor: float | None = None
    # the largest rounding a 16-bit product leaves in values an exponential reads
    # (logits): exponentiated, it is a relative error, and k times sharper logits are
    # rounded k times coarser, which no rule keeps fp32 (products stay 16-bit)
    logit_rounding: float | None = None
    logit_node: str = ""
    logit_product: str = ""
    # the largest rounding a 16-bit product leaves in the argument of an op kept fp32
    # as ill-conditioned (sin of Fourier features): kept fp32, the op still passes it
    # on, amplified by its own sensitivity
    amplified: float | None = None
    amplified_node: str = ""
    amplified_product: str = ""
    # the dynamic sizes the decisions were judged at (``fx16.analysis.size_growth``)
    lengths: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """What the command line prints: what holds for every input, then what was observed."""
        lines = [
            f"holds for every input: {self.rewritten} stable rewrite(s), "
            f"{self.proven} integer(s) narrowed on a proven or declared range"
        ]
        if not observed(self.calibration):
            lines.append(f"calibration {self.calibration}: nothing else was observed")
            return lines
        lines.append(f"{self.calibration}, with an overflow margin of {self.margin:g}x")
        if self.lengths:
            lines.append(
                "  dynamic sizes: values that grow with them judged at " + ", ".join(self.lengths)
            )
        if self.headroom is not None:
            grows = (
                ""
                if self.headroom_degree == 1
                else f", which grows as the inputs ** {self.headroom_degree:g}"
            )
            lines.append(
                f"  larger inputs: float inputs up to {self.headroom:.3g}x the calibration "
                f"inputs keep 16-bit values in range (tightest: {self.headroom_node}{grows})"
            )
        if self.quiet_factor is not None:
            lines.append(
                f"  quieter inputs: {self.quietest_node} reads values down to "
                f"{self.quietest:.3g} in 16-bit; inputs {self.quiet_factor:.3g}x quieter "
                "leave 16-bit's normal range there and were never observed"
            )
        if self.amplified is not None:
            lines.append(
                f"  amplified rounding: {self.amplified_node} is kept fp32 but reads the "
                f"16-bit product {self.amplified_product}, rounded by up to "
                f"{self.amplified:.3g}, which it passes on; keep the product fp32 "
                f"(force_fp32=[{self.amplified_product!r}]) or give the cast a budget "
                "(max_rel_error=1e-2)"
            )
        if self.logit_rounding is not None:
            lines.append(
                f"  sharper logits: {self.logit_node} exponentiates values the 16-bit product "
                f"{self.logit_product} rounds by up to {self.logit_rounding:.3g}; logits k "
                "times sharper are rounded k times coarser (a budget keeps that product fp32)"
            )
        return lines


def envelope(ep: ExportedProgram, margin: float) -> Envelope:
    """The envelope of the cast program ``ep``, cast with ``margin`` (see the module)."""
    rewritten = proven = 0
    degrees = input_degrees(ep)
    bounds = growth_bounds(ep, degrees)
    unbounded = False  # a value that mixes degrees with no bound: no figure is stated
    headroom: tuple[float, str, float] | None = None
    quiet: tuple[float, float, str] | None = None
    logits: tuple[float, str, str] | None = None
    amplified: tuple[float, str, str] | None = None
    for body, module in named_graph_modules(ep.graph_module):
        for node in module.graph.nodes:
            rewritten += bool(meta.stabilized(node))
            decision = node.meta.get(PRECISION)
            val = node_val(node)
            if not (isinstance(val, torch.Tensor) and val.dtype in SIXTEEN_BIT):
                proven += bool(_narrowed_on_proof(node))
                continue
            found = _overflow_factor(node, val.dtype, degrees, bounds, decision)
            unbounded = unbounded or found is _UNBOUNDED
            if found not in (None, _UNBOUNDED) and (headroom is None or found[0] < headroom[0]):
                headroom = (found[0], qualified_name(body, node.name), found[1])
            found = _quietest_argument(node, val.dtype)
            if found is not None and (quiet is None or found[0] < quiet[0]):
                quiet = (*found, qualified_name(body, node.name))
        for node in module.graph.nodes:
            found = _logit_rounding(node)
            if found is not None and (logits is None or found[0] > logits[0]):
                logits = _named_in(body, found, node)
            found = _amplified_rounding(node)
            if found is not None and (amplified is None or found[0] > amplified[0]):
                amplified = _named_in(body, found, node)
    status = ep.graph_module.meta.get(meta.CALIBRATION_STATUS, "skipped: not run")
    headroom = None if unbounded else headroom
    return Envelope(
        calibration=status,
        margin=margin,
        rewritten=rewritten,
        proven=proven,
        headroom=headroom[0] if headroom else None,
        headroom_node=headroom[1] if headroom else "",
        headroom_degree=headroom[2] if headroom else 1.0,
        quietest=quiet[1] if quiet else None,
        quietest_node=quiet[2] if quiet else "",
        quiet_factor=quiet[0] if quiet else None,
        logit_rounding=logits[0] if logits else None,
        logit_product=logits[1] if logits else "",
        logit_node=logits[2] if logits else "",
        amplified=amplified[0] if amplified else None,
        amplified_product=amplified[1] if amplified else "",
        amplified_node=amplified[2] if amplified else "",
        lengths=tuple(ep.graph_module.meta.get(meta.DYNAMIC_LENGTHS, ())),
    )


def _named_in(body: str, found: tuple[float, str], node: Node) -> tuple[float, str, str]:
    """(the figure, the product ``found`` names, ``node``), both named as reports name
    a node of the graph at ``body``."""
    return found[0], qualified_name(body, found[1]), qualified_name(body, node.name)


_UNBOUNDED = object()  # what ``_overflow_factor`` gives a value it has no bound for


def _overflow_factor(node: Node, dtype, degrees: dict, bounds: dict, decision):
    """(how many times larger the program's float inputs may grow before the 16-bit
    ``node`` passes the 16-bit maximum, the power its values grow by) where calibration
    observed it and it grows with them; None otherwise; ``_UNBOUNDED`` where it mixes
    degrees of growth and no bound is known (``fx16.report.growth_bounds``). A cast to
    16-bit (fx16's, a scaled input's at the door, or the model's own) holds what its
    source held; a value that mixes degrees is judged by its bound, not its maximum; an
    exponential of a value growing as the inputs ** d overflows where its largest
    argument reaches log(maximum), at (log(maximum) / largest) ** (1 / d)."""
    source = node.args[0] if is_cast(node) else node
    if source is node and decision is None:
        return None
    if meta.scaled(source) or meta.rounding_cancels(source):  # bounded for any input
        return None
    degree = degrees.get(source)
    if degree is None and op_name(source) in EXPONENTIAL_GROWTH_OPS:
        return _exponential_factor(source, dtype, degrees, bounds)
    observed = bounds[source] if source in bounds else meta.observed_max_abs(source)
    if source in bounds and observed is None and degree and degree > 0:
        return _UNBOUNDED
    if not (degree and degree > 0 and observed and math.isfinite(observed)):
        return None
    return (largest(dtype) / observed) ** (1.0 / degree), degree


def _exponential_factor(node: Node, dtype, degrees: dict, bounds: dict):
    """The factor at which an exponential's argument reaches log(maximum): a growing
    argument's by its top (or bound) and degree, an exponential argument's in turn at
    the log of that (``exp(exp(x))``); ``_UNBOUNDED`` where the chain ends in a value
    that grows faster than any power otherwise, or where its limit is not above 1."""
    base = 2.0 if op_name(node) == "exp2" else math.e
    limit = math.log(largest(dtype), base)
    argument = node.args[0] if node.args else None
    while isinstance(argument, Node) and degrees.get(argument) is None:
        if op_name(argument) not in EXPONENTIAL_GROWTH_OPS or limit <= 1:
            return _UNBOUNDED
        base = 2.0 if op_name(argument) == "exp2" else math.e
        shift = 1.0 if op_name(argument) == "expm1" else 0.0
        limit = math.log(limit + shift, base)
        argument = argument.args[0]
    degree = degrees.get(argument)
    interval = meta.observed_interval(argument)
    if not (degree and degree > 0 and interval and interval[1] > 0):
        return None
    top = interval[1]
    if argument in bounds:  # mixes degrees: its bound, where it has one
        if bounds[argument] is None:
            return _UNBOUNDED
        top = bounds[argument]
    return (limit / top) ** (1.0 / degree), degree


def _narrowed_on_proof(node: Node) -> bool:
    """An integer narrowed to int16 on a range proven (or declared by the user) for
    every input, not observed."""
    val, found = node_val(node), meta.proven_range(node)
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.int16):
        return False
    return isinstance(found, ValueRange) and found.source != Source.OBSERVED


def _quietest_argument(node: Node, dtype: torch.dtype) -> tuple[float, float] | None:
    """(how many times quieter, the smallest value seen) for the argument of a 16-bit
    op singular at zero that calibration observed; None where a rewrite or a scalar
    guard in 16-bit's normal range bounds it below, or nothing was observed."""
    argument = singular_argument(node)
    while isinstance(argument, Node) and is_cast(argument):  # fx16's cast to 16-bit
        argument = argument.args[0]
    if not isinstance(argument, Node):
        return None
    end = small_end(argument)
    if end.kind == "bounded" or end.guard >= smallest_normal(dtype):  # bounded for any input
        return None
    smallest = argument.meta.get(meta.OBSERVED_SMALLEST)
    if not smallest:
        return None
    return smallest / smallest_normal(dtype), smallest


def _logit_rounding(node: Node) -> tuple[float, str] | None:
    """(half a 16-bit ulp of the largest value seen, the product) where ``node``
    exponentiates (softmax, exp, sigmoid) what a 16-bit product computed."""
    if node.op != "call_function" or node.target not in EXPONENTIALS:
        return None
    return _product_read(node)


EXPONENTIALS = EXPONENTIAL_TAIL_OPS | SOFTMAX_OPS

# An argument's rounding below this (4 units of fp16's roundoff, relative to values of
# order one) is what any 16-bit cast gives: not worth a line.
_NOTICEABLE = 4 * 2.0**-11


def _amplified_rounding(node: Node) -> tuple[float, str] | None:
    """(half a 16-bit ulp of the largest value seen, the product) where ``node`` is kept
    fp32 as ill-conditioned and reads what a 16-bit product computed, past what a
    16-bit cast's own rounding gives."""
    decision = node.meta.get(PRECISION)
    if decision is None or decision.reason is not Reason.ILL_CONDITIONED:
        return None
    found = _product_read(node)
    if found is None or found[0] <= _NOTICEABLE:
        return None
    return found


def _product_read(node: Node) -> tuple[float, str] | None:
    """(half a 16-bit ulp of the largest value seen, its name) of the 16-bit product
    ``node`` reads as its first argument (through fx16's casts); None otherwise."""
    source = node.args[0] if node.op == "call_function" and node.args else None
    while isinstance(source, Node) and is_cast(source):
        source = source.args[0]
    if not (isinstance(source, Node) and is_product(source)):
        return None
    val = node_val(source)
    largest_seen = meta.observed_max_abs(source)
    if not (isinstance(val, torch.Tensor) and val.dtype in SIXTEEN_BIT and largest_seen):
        return None
    return largest_seen * torch.finfo(val.dtype).eps / 2, source.name
