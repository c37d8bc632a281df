"""StoreAsReadPass: a state tensor decided for 16-bit that every reader casts back up is
stored in fp32 instead."""

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.analysis.facts import Facts
from fx16.decisions import Reason, decide
from fx16.plan.graph_inputs import record_rule
from fx16.program import Program
from fx16.program.casts import cast_dtype, is_cast, is_inserted, retype_val
from fx16.program.snapshot import PENDING

FP32 = torch.float32


class StoreAsReadPass(PassBase):
    """Keep in fp32 each state tensor that the cast inserter reads only through casts
    to fp32 of its own: stored 16-bit, it would be cast up on every call, and its fp32
    readers would see it rounded for nothing (an ``overflow_margin`` under which every
    op computes in fp32; a router's gate, which ``routing="fp32"`` keeps wide).

    Input graph:  w (fp16 pending) -> c = to(w, f32) -> linear(x, c)
    Output graph: w (fp32)         -> linear(x, w)

    A tensor stored under several names moves only when every name qualifies (it stays
    stored once). Tensors already rebuilt (subclasses) and values that cross into a
    higher-order op's body are left as they are.

    Reads: the pending state conversions (``Program.store_state``), the placeholders'
    users and ``meta["fx16.inserted"]``. Writes: the pending conversion dropped, the
    placeholder's ``meta["val"]`` and ``meta["fx16.precision"]`` (``readers_fp32``), the
    casts removed.
    """

    def __init__(self, program: Program) -> None:
        self.program = program

    def call(self, graph_module: GraphModule) -> PassResult:
        pending = graph_module.meta.get(PENDING) or {}
        names: dict[int, list] = {}  # tensor id -> its slots (tied weights share one)
        for slot in self.program.state_slots():
            if slot.target in pending and pending[slot.target][0] != FP32:
                tensor = self.program.state_tensor(slot.target)
                names.setdefault(id(tensor), []).append(slot)
        modified = False
        for slots in names.values():
            if not all(_read_only_through_fp32_casts(slot.placeholder) for slot in slots):
                continue
            for slot in slots:
                self.program.store_state(slot.target, FP32, may_flush=False)
                placeholder = slot.placeholder
                placeholder.meta["val"] = retype_val(placeholder.meta["val"], FP32)
                decide(placeholder, FP32, Reason.READERS_FP32)
                record_rule(placeholder, "stored_as_read")
                for cast in list(placeholder.users):
                    cast.replace_all_uses_with(placeholder)
                    cast.graph.erase_node(cast)
            modified = True
        if modified:
            Facts.invalidate(graph_module)  # nodes removed
        return PassResult(graph_module, modified)


def _read_only_through_fp32_casts(placeholder) -> bool:
    users = list(placeholder.users)
    return bool(users) and all(
        is_inserted(user) and is_cast(user) and cast_dtype(user) == FP32 for user in users
    )
