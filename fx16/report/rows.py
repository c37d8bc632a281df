"""The report's rows and totals: one row per decision fx16 made (a node, a state
tensor, a region of the model's), and the figures of the whole program."""

import operator
from dataclasses import dataclass, replace

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx import GraphModule, Node

from fx16 import meta
from fx16.analysis.explicit_fp32 import islands
from fx16.analysis.intervals import ValueRange
from fx16.analysis.scale_domains import scale_domains
from fx16.decisions import INT_PRECISION, PRECISION, Decision, Reason, reasons
from fx16.ops.int_ops import WIDE_INT_DTYPES
from fx16.program import Program
from fx16.program.casts import INSERTED, WHY_RETARGETED, is_inserted
from fx16.program.cost import flops, is_product, tensor_bytes
from fx16.program.nodes import dtype_name, node_dtype, node_module_path, node_val, op_label
from fx16.program.stats import ProgramStats, program_stats
from fx16.program.subgraphs import named_graph_modules, qualified_name
from fx16.report.envelope import Envelope, envelope

# Rules of integer rows outside the castable set (see CastReport.explained).
NEVER_INT16_CANDIDATES = frozenset(
    {"left_as_is"} | {r.name.lower() for r in reasons(never_int16=True)}
)
_SLOT_KINDS = {InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer"}
LEFT_AS_IS = "not fp32: left as the model computes it"


@dataclass(frozen=True)
class Row:
    node: str
    op: str
    kind: str  # "float" or "int"
    dtype: str
    narrowed: bool
    rule: str  # short name of the rule that decided, e.g. "activation_overflow"
    reason: str
    detail: str
    module: str = ""  # the module path the node belongs to ("model.layers.0.mlp"), if known
    flops: int = 0  # what the op computes per call (in the dtype above)
    product: bool = False  # a matrix product, convolution or attention
    bytes: int = 0  # what the value holds (for a weight kept fp32, the bytes it keeps)
    # the numbers behind the decision, where the analyses found them
    observed: tuple[float, float] | None = None  # smallest and largest on calibration
    observed_max_abs: float | None = None  # largest magnitude on calibration
    proven: tuple[float, float] | None = None  # an integer value's proven range
    condition_number: float | None = None  # an ill-conditioned op's
    # an fp32 result whose consumers read it in fp32 (no cast back to 16-bit): why
    cast_back_skipped: str = ""
    # the stable rewrite (StabilizePass) that made this value: "rule: detail"
    stabilized: str = ""
    # the plan's precedence rule that chose (fx16.plan.precedence: "safety_rule", "fp32_input")
    chosen_by: str = ""
    # e where a scale domain carries the value at 2**e (fx16.analysis.scale_domains), else 0
    scale_exponent: int = 0
    # why its fill is carried as an infinity-like sentinel (fx16.passes.sentinel_fills)
    sentinel_fill: str = ""

    def why(self) -> str:
        """The reason with its detail, the scale the value is carried at, and the
        precedence rule where its name says more ("... [chosen by policy_follow]")."""
        why = self.reason + (f": {self.detail}" if self.detail else "")
        if self.scale_exponent:
            why += f", carried at 2**{self.scale_exponent} (a scale domain)"
        if self.sentinel_fill:
            why += f"; {self.sentinel_fill}"
        if self.chosen_by and self.chosen_by != self.rule:
            why += f" [chosen by {self.chosen_by}]"
        return why

    def cost(self) -> str:
        """What keeping this value in fp32 costs per call, for a row that does."""
        if self.narrowed or self.kind != "float" or self.rule == "left_as_is":
            return ""
        if self.flops:
            return f"{human(self.flops)}FLOPs" + (
                " (matmul/conv/attention)" if self.product else ""
            )
        return f"{human(self.bytes)}B" if self.bytes else ""  # a weight, an input


@dataclass(frozen=True)
class Totals:
    weight_bytes_before: int
    weight_bytes_after: int
    casts_before: int
    casts_after: int
    casts_inserted: int
    model_casts_removed: int | None  # None: not known (a report built after the fact)
    float_ops: int
    float_ops_16bit: int
    product_flops: int = 0  # matrix products, convolutions, attention: FLOPs per call
    product_flops_16bit: int = 0  # of those, computed in 16-bit
    cast_bytes: int = 0  # bytes every cast of the program reads and writes per call
    fp32_weight_bytes: int = 0
    envelope: Envelope | None = None  # the inputs under which the decisions hold
    scale_domains: tuple[str, ...] = ()  # each scale domain, described

    @property
    def share_16bit(self) -> float:
        return self.float_ops_16bit / self.float_ops if self.float_ops else 1.0

    @property
    def flop_share_16bit(self) -> float:
        """The headline figure: the share of matmul/conv/attention FLOPs in 16-bit."""
        return self.product_flops_16bit / self.product_flops if self.product_flops else 1.0


def _row(
    node: Node, kind: str, decision: Decision | None, body: str = "", inputs: dict | None = None
) -> Row:
    """``inputs``: each graph input of the program by name, as (its kind: "parameter",
    "buffer", "constant", "input"; the module owning it: a weight's node has no module
    stack)."""
    name = qualified_name(body, node.name)
    role, owner = ("", "") if body else (inputs or {}).get(node.name, ("", ""))
    module = node_module_path(node) or owner
    op = role or op_label(node)  # a body's input is a "placeholder"
    costs = {
        "flops": flops(node),
        "product": is_product(node),
        "bytes": tensor_bytes(node_val(node)),
        **_numbers(node),
    }
    if decision is None:
        dtype = node_dtype(node)
        narrowed = dtype == torch.float16
        return Row(
            name,
            op,
            kind,
            dtype_name(dtype),
            narrowed,
            "left_as_is",
            LEFT_AS_IS,
            "",
            module,
            **costs,
        )
    if not decision.detail and kind == "int" and meta.proven_range(node):
        decision = replace(decision, detail=str(meta.proven_range(node)))
    return replace(_decision_row(name, op, kind, decision, module), **costs)


def _numbers(node: Node) -> dict:
    """The ranges and condition number the analyses recorded on ``node``, what the
    inserter's plan said of it (the rule that chose; why its consumers read it in fp32
    where it has no cast-back), and the stable rewrite that made it."""
    numbers = {}
    interval = meta.observed_interval(node)
    if interval is not None:
        numbers["observed"] = tuple(map(float, interval))
    magnitude = meta.observed_max_abs(node)
    if magnitude is not None:
        numbers["observed_max_abs"] = float(magnitude)
    proven = meta.proven_range(node)
    if isinstance(proven, ValueRange):
        numbers["proven"] = (float(proven.low), float(proven.high))
    finding = meta.conditioning_finding(node)
    if finding is not None:
        numbers["condition_number"] = float(finding.kappa)
    planned = meta.planned(node)
    if planned is not None:
        numbers["chosen_by"] = planned.rule
        numbers["cast_back_skipped"] = planned.cast_back_skipped
    if meta.scale_exponent(node):
        numbers["scale_exponent"] = meta.scale_exponent(node)
    if meta.sentinel_fill(node):
        numbers["sentinel_fill"] = meta.sentinel_fill(node)
    if meta.stabilized(node):
        name, detail = meta.stabilized(node)
        numbers["stabilized"] = f"{name}: {detail}" if detail else name
    return numbers


def _decision_row(name: str, op: str, kind: str, decision: Decision, module: str = "") -> Row:
    return Row(
        name,
        op,
        kind,
        dtype_name(decision.dtype),
        decision.narrowed,
        decision.reason.name.lower(),
        decision.reason.value,
        decision.detail,
        module,
    )


def layer_of(module: str) -> str:
    """A module path up to its first index ("model.layers.3" of "model.layers.3.mlp")."""
    if not module:
        return "(no module)"
    parts = module.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    return ".".join(parts[: index + 1])


def _island_rows(graph_module: GraphModule, body: str, listed: set[str]) -> list[Row]:
    """Rows for the model's own fp32 casts whose verdict has no row of its own: a
    retargeted cast cleanup removed, a decomposed cast's fp32 check."""
    rows = []
    for island in islands(graph_module):
        name = qualified_name(body, island.opening)
        if name not in listed:
            reason = Reason.EXPLICIT_FP32 if island.keep else Reason.EXPLICIT_FP32_RETARGETED
            decision = Decision(island.dtype, reason, island.why)
            rows.append(_decision_row(name, island.op, "float", decision))
    return rows


def decision_rows(ep: ExportedProgram) -> list[Row]:
    """One row per float value, then per integer value the int16 pipeline looked at;
    each in the program's graph first, then in the body of each higher-order op (rows
    named ``body.node``, e.g. ``true_graph_0.exp``).

    Casts fx16 inserted are not listed (the totals count them), nor a ``getitem`` of a
    result no op reads; the model's own casts it retargeted are, and so are the fp32
    checks a decomposed program keeps of the model's casts that open a region
    (``fx16.analysis.explicit_fp32``).
    """
    graphs = named_graph_modules(ep.graph_module)
    nodes = [
        (body, n)
        for body, module in graphs
        for n in module.graph.nodes
        if n.op in ("placeholder", "call_function")
        and (not is_inserted(n) or n.meta[INSERTED] == WHY_RETARGETED)
        and not _unread_item(n)
    ]
    int16_ran = any(INT_PRECISION in n.meta for _, n in nodes)
    program = Program.of(ep)
    inputs = {p.name: ("input", "") for p in program.user_input_placeholders()}
    inputs |= {
        slot.placeholder.name: (
            _SLOT_KINDS.get(slot.kind, "constant"),
            slot.target.rpartition(".")[0],
        )
        for slot in program.state_slots()
    }
    rows = [
        _row(n, "float", n.meta.get(PRECISION), body, inputs)
        for body, n in nodes
        if PRECISION in n.meta or getattr(node_dtype(n), "is_floating_point", False)
    ]
    listed = {row.node for row in rows}
    rows += [row for body, module in graphs for row in _island_rows(module, body, listed)]
    rows += [
        _row(n, "int", n.meta.get(INT_PRECISION), body, inputs)
        for body, n in nodes
        if INT_PRECISION in n.meta or (int16_ran and node_dtype(n) in WIDE_INT_DTYPES)
    ]
    return rows


def _unread_item(node: Node) -> bool:
    """A ``getitem`` no op reads: ``torch.export.load`` makes one for each unused result
    of an op with several (``..._unused_1``); it holds no value anyone sees."""
    return node.target is operator.getitem and not node.users


def totals(ep: ExportedProgram, before: ProgramStats | None, margin: float = 2.0) -> Totals:
    """The figures of ``ep`` after its cast, beside ``before``'s, and the envelope of
    its decisions (made with the overflow ``margin``)."""
    after = program_stats(ep)
    model_casts = after.casts - after.inserted_casts
    return Totals(
        weight_bytes_before=before.weight_bytes if before else _bytes_before(ep),
        weight_bytes_after=after.weight_bytes,
        casts_before=before.casts if before else model_casts,
        casts_after=after.casts,
        casts_inserted=after.inserted_casts,
        model_casts_removed=max(before.casts - model_casts, 0) if before else None,
        float_ops=after.float_ops,
        float_ops_16bit=after.ops_in(torch.float16) + after.ops_in(torch.bfloat16),
        product_flops=after.product_flops,
        product_flops_16bit=after.product_flops_16bit,
        cast_bytes=after.cast_bytes,
        fp32_weight_bytes=after.fp32_weight_bytes,
        envelope=envelope(ep, margin),
        scale_domains=tuple(domain.describe() for domain in scale_domains(ep.graph_module)),
    )


def _bytes_before(ep: ExportedProgram) -> int:
    """The state's bytes before a cast: each tensor narrowed from fp32 took twice its size."""
    total, program = program_stats(ep).weight_bytes, Program.of(ep)
    for slot in program.state_slots():
        tensor = program.state_tensor(slot.target)
        decision = slot.placeholder.meta.get(PRECISION)
        if decision is not None and decision.narrowed and isinstance(tensor, torch.Tensor):
            total += tensor.numel() * tensor.element_size()
    return total


def human(amount: float) -> str:
    """1234567 as "1.23 M": an amount with an SI prefix."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if amount >= scale:
            return f"{amount / scale:.3g} {prefix}"
    return f"{amount:.3g} "
