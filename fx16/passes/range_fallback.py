"""RangeFallbackPass: ops kept fp32 for range alone compute in bf16 instead (opt-in)."""

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16 import meta
from fx16.analysis.facts import Facts
from fx16.decisions import PRECISION, Decision, Reason, decision_of, reasons
from fx16.plan.planner import role
from fx16.plan.view import DOWNCASTABLE
from fx16.program import Program
from fx16.program.aliases import written_in_place
from fx16.program.casts import (
    WHY_UPCAST,
    CastInserter,
    cast_dtype,
    is_cast,
    is_inserted,
    retype_val,
)
from fx16.program.cost import is_product
from fx16.program.nodes import dtype_arguments, mutated_argument, node_val

FP32, BF16 = torch.float32, torch.bfloat16
BF16_LARGEST = float(torch.finfo(BF16).max)

# The causes of an fp32 decision that are about range alone: bf16 has fp32's exponents.
RANGE_REASONS = reasons(family="range")

SAID = "computed in bf16 (range_fallback='bf16')"
STORED = "stored in bf16: every reader computes in bf16 (range_fallback='bf16')"


class RangeFallbackPass(PassBase):
    """Compute in bf16, rather than fp32, every op of an fp16 program that the cast
    kept in fp32 for range alone: a value beyond fp16's range or below its normal range
    that no power-of-two scale could carry (logits a softmax reads unscaled), and the
    ops that are fp32 only because they read such a value. bf16 has fp32's exponent
    range and 8 significant bits: for targets that compute in both 16-bit dtypes (the
    policy's ``range_fallback="bf16"``), it keeps those products 16-bit at bf16's
    rounding instead of paying fp32.

    Input graph:  h (fp16) -> up = to(h, f32) -> mm(up, w) [activation_overflow] -> exp
    Output graph: h (fp16) -> b = to(h, bf16) -> mm(b, w) [bf16]                -> exp [bf16]

    An op joins when its decision's reason is a range cause (``RANGE_REASONS``), or
    ``fp32_input`` where every fp32 input it reads is such an op, a value kept fp32
    for range, or one kept fp32 for precision that a 16-bit op may read
    (``DOWNCASTABLE``). Ops of several results, with dtype arguments, written in
    place, in a body, and higher-order ops stay fp32, as does an op that holds or
    reads a value observed past bf16's largest (3.39e38), an op that also feeds an
    ill-conditioned one (``meta["fx16.ill_conditioned"]``: ``x - (x + y)`` before an exp,
    whose cancellation bf16's 8 bits would spoil), an op of a region the model
    computes in fp32 itself that the cast keeps, ``type_as``, and an elementwise op whose
    result the program returns (in bf16 the answer would keep 8 bits where the default
    gives fp32's, for the cost of one elementwise op; a returned product is moved). Its
    inputs are read through casts to bf16 (an inserted upcast of a 16-bit value is
    pointed at bf16 instead); its
    consumers that are not bf16 ops read it through a cast to fp32 (the program's
    outputs and a body's operands keep their dtypes), and a cast-back to fp16 after it
    stays. A state tensor kept fp32 that only such ops read is stored in bf16.

    Reads: ``meta["fx16.precision"]``, ``meta["fx16.ill_conditioned"]``, the casts the
    inserter placed, and the regions
    kept fp32 (``graph_module.meta["fx16.explicit_fp32"]``). Writes: the
    ops' ``meta["val"]`` and decisions (dtype bf16, the cause kept, the detail saying
    so), the casts, the pending state conversions.
    """

    def __init__(self, program: Program) -> None:
        self.program = program

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        moved = _moved_to_bf16(graph_module)
        if not moved:
            return PassResult(graph_module, False)
        inserter = CastInserter(graph)
        for node in moved:
            for arg in node.all_input_nodes:
                if arg not in moved and _is_float(arg):
                    node.replace_input_with(arg, _bf16_source(arg, inserter))
        for node in moved:
            node.meta["val"] = retype_val(node.meta["val"], BF16)
            made = decision_of(node)
            # an op fp32 only for reading such values reads them in bf16 now
            reason = Reason.BF16_INPUT if made.reason is Reason.FP32_INPUT else made.reason
            node.meta[PRECISION] = Decision(BF16, reason, _with(made.detail, SAID))
            for user in list(node.users):
                if user not in moved and not (is_inserted(user) and is_cast(user)):
                    user.replace_input_with(node, inserter.cast(node, FP32, WHY_UPCAST))
        for cast in [n for n in graph.nodes if is_inserted(n) and is_cast(n) and not n.users]:
            graph.erase_node(cast)  # upcasts the moved ops no longer read
        self._store_state_in_bf16(graph_module)
        self.program.sync_output_specs()  # an output now returns through a cast
        Facts.invalidate(graph_module)
        return PassResult(graph_module, True)

    def _store_state_in_bf16(self, graph_module: GraphModule) -> None:
        """Store in bf16 each fp32 state tensor read only through this pass's casts to
        bf16 (every name of a tied one), dropping those casts."""
        slots_of: dict[int, list] = {}
        for slot in self.program.state_slots():
            if self.program.state_dtype(slot.target) == FP32:
                tensor = self.program.state_tensor(slot.target)
                slots_of.setdefault(id(tensor), []).append(slot)
        for slots in slots_of.values():
            if not all(_read_only_as_bf16(slot.placeholder) for slot in slots):
                continue
            for slot in slots:
                placeholder = slot.placeholder
                # an fp32 subnormal may lie below bf16's
                self.program.store_state(slot.target, BF16, may_flush=True)
                placeholder.meta["val"] = retype_val(placeholder.meta["val"], BF16)
                made = decision_of(placeholder)
                reason = made.reason if made is not None else Reason.READERS_FP32
                detail = _with(made.detail if made is not None else "", STORED)
                placeholder.meta[PRECISION] = Decision(BF16, reason, detail)
                for cast in list(placeholder.users):
                    cast.replace_all_uses_with(placeholder)
                    graph_module.graph.erase_node(cast)
        if not self.program.defers_state:
            self.program.commit_state()


def _moved_to_bf16(graph_module: GraphModule) -> set[Node]:
    """The ops to compute in bf16, found in one walk in graph order (an op's inputs are
    settled before it)."""
    moved: set[Node] = set()
    regions = _kept_region_members(graph_module)
    # an elementwise op whose result the program returns keeps the answer at fp32's
    # precision, as the default gives it (a product there is worth bf16's trade)
    returned = {
        node for node in graph_module.graph.output_node().all_input_nodes if not is_product(node)
    }
    for node in graph_module.graph.nodes:
        if (
            node.name not in regions
            and node not in returned
            and _fp32_op(node)
            and _kept_for_range(node, moved)
            and _fits_bf16(node, moved)
        ):
            moved.add(node)
    return moved


def _kept_region_members(graph_module: GraphModule) -> frozenset[str]:
    """The ops of the model's own fp32 regions that the cast keeps (an RMSNorm's
    variance after ``x.float()``): fp32 in the default whatever else holds them there,
    so the fallback leaves them fp32 too (at bf16's 8 bits a norm's statistic would be
    worse than the default's, not only cheaper)."""
    islands = graph_module.meta.get(meta.ISLANDS) or ()
    return frozenset(name for island in islands if island.keep for name in island.members)


def _fits_bf16(node: Node, moved: set[Node]) -> bool:
    """Neither ``node`` nor an fp32 input it would read through a cast to bf16 was
    observed beyond bf16's largest value (3.39e38: fp32's last 0.4% of range, where a
    value near fp32's largest, a ``-3.4e38`` fill, rounds to inf in bf16)."""
    return all(
        (meta.observed_max_abs(value) or 0.0) <= BF16_LARGEST
        for value in (node, *(arg for arg in node.all_input_nodes if arg not in moved))
    )


def _fp32_op(node: Node) -> bool:
    """An op the cast computes in fp32 whose one result is an fp32 tensor, which bf16
    can compute as it is: no dtype argument, no write in place; not a higher-order op,
    a getitem, a cast or a creation op (``role``), nor ``type_as`` (a conversion to
    another value's dtype: in bf16 it would round a 16-bit value to 8 bits)."""
    if node.op != "call_function" or role(node.target) != "op" or is_cast(node):
        return False
    if node.target is torch.ops.aten.type_as.default:
        return False
    made = decision_of(node)
    val = node_val(node)
    return (
        made is not None
        and made.dtype == FP32
        and isinstance(val, torch.Tensor)
        and val.dtype == FP32
        and not dtype_arguments(node)
        and mutated_argument(node) is None
        and not written_in_place(node)
    )


def _kept_for_range(node: Node, moved: set[Node]) -> bool:
    if meta.range_scaled(node):
        # a scale domain's power-of-two multiply, exact in fp32; in bf16 only on a value
        # that is bf16 already (else it would round what it scales to 8 bits)
        return all(arg in moved for arg in node.all_input_nodes if _is_float(arg))
    if meta.ill_conditioned(node):
        # it also feeds an ill-conditioned op (``x - (x + y)`` before an exp): kept fp32
        # for range first, its precision matters too, and bf16 keeps 8 bits of it
        return False
    reason = decision_of(node).reason
    if reason in RANGE_REASONS:
        return True
    if reason is not Reason.FP32_INPUT:
        return False
    return all(_bf16_may_read(arg, moved) for arg in node.all_input_nodes if _is_fp32(arg))


def _bf16_may_read(arg: Node, moved: set[Node]) -> bool:
    """A bf16 op may read the fp32 ``arg``: it is bf16 already, an upcast fx16 made of a
    16-bit value, or fp32 for range or for a precision a 16-bit op may give up."""
    if arg in moved or (is_inserted(arg) and is_cast(arg)):
        return True
    made = decision_of(arg)
    return made is not None and (made.reason in RANGE_REASONS or made.reason in DOWNCASTABLE)


def _bf16_source(arg: Node, inserter: CastInserter) -> Node:
    """What a bf16 op reads in place of its float input ``arg``: a bf16 cast of the
    16-bit value an inserted upcast widened, else of ``arg`` itself."""
    if is_inserted(arg) and is_cast(arg) and cast_dtype(arg) == FP32:
        arg = arg.args[0]
    if node_val(arg).dtype == BF16:
        return arg
    return inserter.cast(arg, BF16, WHY_UPCAST)


def _read_only_as_bf16(placeholder: Node) -> bool:
    users = list(placeholder.users)
    return bool(users) and all(
        is_inserted(user) and is_cast(user) and cast_dtype(user) == BF16 for user in users
    )


def _is_float(node: Node) -> bool:
    val = node_val(node)
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _is_fp32(node: Node) -> bool:
    val = node_val(node)
    return isinstance(val, torch.Tensor) and val.dtype == FP32


def _with(detail: str, said: str) -> str:
    return f"{detail}; {said}" if detail else said
