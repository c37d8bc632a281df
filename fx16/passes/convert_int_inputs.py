"""ConvertIntInputsPass: int32/int64 user inputs read by int16 ops become int16 inputs."""

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from fx16.analysis.facts import Facts
from fx16.decisions import INT_PRECISION, Reason, decide
from fx16.ops.int_ops import WIDE_INT_DTYPES
from fx16.passes.int16_pass import Int16Pass
from fx16.plan.narrowing import int16_verdict, may_narrow
from fx16.program.casts import INSERTED, WHY_CAST_BACK, WHY_NARROW, CastInserter, retype_val
from fx16.program.nodes import node_dtype


class ConvertIntInputsPass(Int16Pass):
    """Make a user input int16 when it is castable, fits, and an int16 op reads it.

    Runs after InsertInt16CastsPass: the narrowing casts it put on an input are
    absorbed into the input itself, and the input's other consumers get a cast back
    to its original dtype. Callers pass int16 tensors for those inputs afterwards.

    Reads: the int16 analyses' findings (see ``fx16.plan.narrowing.int16_verdict``) and
    the casts the inserter marked ``meta["fx16.inserted"] == "narrow"``.
    Writes: the placeholders' ``meta["val"]``, ``meta["fx16.int16"]`` on every wide
    integer input, a cast-back where wide consumers remain, the example inputs.
    """

    def call(self, graph_module: GraphModule) -> PassResult:
        casts = CastInserter(graph_module.graph)
        converted = False
        for placeholder in self.program.user_input_placeholders():
            original = node_dtype(placeholder)
            if original not in WIDE_INT_DTYPES or INT_PRECISION in placeholder.meta:
                continue
            narrowing = [u for u in placeholder.users if u.meta.get(INSERTED) == WHY_NARROW]
            reason, detail = int16_verdict(placeholder, self.mode)
            if may_narrow(reason) and not narrowing:
                reason = Reason.NO_INT16_CONSUMER
            if not may_narrow(reason):
                decide(placeholder, original, reason, key=INT_PRECISION, detail=detail)
                continue
            narrow_consumers = {user for cast in narrowing for user in cast.users}
            for cast in narrowing:
                cast.replace_all_uses_with(placeholder)
                graph_module.graph.erase_node(cast)
            placeholder.meta["val"] = retype_val(placeholder.meta["val"], torch.int16)
            wide_consumers = [u for u in placeholder.users if u not in narrow_consumers]
            if wide_consumers:
                back = casts.cast(placeholder, original, WHY_CAST_BACK)
                for user in wide_consumers:
                    user.replace_input_with(placeholder, back)
            decide(placeholder, torch.int16, reason, key=INT_PRECISION, detail=detail)
            converted = True
        if converted:
            self.program.adapt_example_inputs()
        Facts.invalidate(graph_module)  # nodes added, removed or rewired
        return PassResult(graph_module, converted)
