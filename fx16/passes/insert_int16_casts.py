"""InsertInt16CastsPass: compute castable integer ops in int16 where their ranges fit."""

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.fx.passes.infra.pass_base import PassResult

from fx16.analysis.facts import Facts
from fx16.decisions import INT_PRECISION, Reason, decide
from fx16.ops.int_ops import WIDE_INT_DTYPES
from fx16.ops.tables import CREATION_OPS
from fx16.passes.int16_pass import Int16Pass
from fx16.plan.narrowing import int16_verdict, may_narrow
from fx16.program.casts import (
    INSERTED,
    WHY_CAST_BACK,
    WHY_NARROW,
    WHY_RETARGETED,
    CastInserter,
    cast_back_source,
    is_cast,
    is_inserted,
    retype_val,
    set_cast_dtype,
)
from fx16.program.nodes import (
    accepts_keyword,
    dtype_arguments,
    mutated_argument,
    node_dtype,
    node_val,
    set_argument,
)
from fx16.program.propagation import propagate_fake

INT16 = torch.int16


class InsertInt16CastsPass(Int16Pass):
    """Walk the graph in order and move castable int32/int64 ops to int16.

    A node is narrowed when ``fx16.plan.narrowing.int16_verdict`` allows it: castable,
    and (unless ``mode="assume_safe"``) its range and its integer inputs' ranges
    fit int16, so nothing can wrap around. Its wide inputs are cast to int16 and its
    result is cast back to its *original* dtype (int32 or int64) for consumers;
    cleanup then removes the cast pairs between neighbouring int16 ops. The model's
    own integer casts and integer creation ops get ``dtype=torch.int16`` instead.

    Reads: the int16 analyses' findings. Writes: narrowed ops' arguments and
    ``meta["val"]``, inserted casts (``meta["fx16.inserted"]``), ``meta["fx16.int16"]``
    on every wide integer op, the output specs. Nodes already decided are kept.
    """

    def call(self, graph_module: GraphModule) -> PassResult:
        casts = CastInserter(graph_module.graph)
        modified = False
        returned = self.program.output_node().args[0]
        writes_state = {returned[i] for i in self.program.required_output_dtypes()}
        for node in list(graph_module.graph.nodes):
            original = node_dtype(node)
            if (
                node.op != "call_function"
                or original not in WIDE_INT_DTYPES
                or INT_PRECISION in node.meta
                or is_inserted(node)
            ):
                continue
            reason, detail = int16_verdict(node, self.mode)
            writes = node in writes_state or mutated_argument(node) is not None
            if writes and (may_narrow(reason) or reason is Reason.NOT_USER_REACHABLE):
                # a state update (a batch norm's num_batches_tracked += 1) is not
                # constant-foldable, whatever it reads
                reason, detail = Reason.IN_PLACE, ""
            if may_narrow(reason) and not self._narrow(node, casts):
                reason, detail = Reason.NOT_INT16_OP, ""
            narrowed = may_narrow(reason)
            decide(node, INT16 if narrowed else original, reason, key=INT_PRECISION, detail=detail)
            if narrowed:
                casts.cast_after(node, original, WHY_CAST_BACK)
                modified = True
        if modified:
            self.program.sync_output_specs()
        Facts.invalidate(graph_module)  # nodes added, removed or rewired
        return PassResult(graph_module, modified)

    def _narrow(self, node: Node, casts: CastInserter) -> bool:
        """Rewrite ``node`` to compute in int16; False (and no change) if it cannot."""
        if is_cast(node):
            set_cast_dtype(node, INT16)
            node.meta[INSERTED] = WHY_RETARGETED
            return True
        if node.target in CREATION_OPS:
            node.kwargs = {**node.kwargs, "dtype": INT16}
            node.meta["val"] = retype_val(node.meta["val"], INT16)
            return True
        narrowed_inputs = {}
        for arg in node.all_input_nodes:
            if node_dtype(arg) in WIDE_INT_DTYPES:
                narrowed_inputs[arg] = cast_back_source(arg, INT16)
        # Integer reductions (sum, cumsum) promote to int64 unless told a dtype: tell them.
        dtype_locations = [loc for loc, dtype in dtype_arguments(node) if dtype in WIDE_INT_DTYPES]
        if not dtype_locations and accepts_keyword(node, "dtype"):
            dtype_locations = [("kwargs", "dtype")]

        def trial_val(arg: Node):
            return retype_val(node_val(arg), INT16) if arg in narrowed_inputs else node_val(arg)

        trial_inputs = map_arg(node.args, trial_val)
        trial_kwargs = map_arg(node.kwargs, trial_val)
        for kind, key in dtype_locations:
            if kind == "args":
                trial_inputs = (*trial_inputs[:key], INT16, *trial_inputs[key + 1 :])
            else:
                trial_kwargs = {**trial_kwargs, key: INT16}
        result = propagate_fake(node, trial_inputs, trial_kwargs)
        if not isinstance(result, torch.Tensor) or result.dtype != INT16:
            return False
        for arg, source in narrowed_inputs.items():
            narrowed_inputs[arg] = source or casts.cast(arg, INT16, WHY_NARROW)
        node.args = map_arg(node.args, lambda a: narrowed_inputs.get(a, a))
        node.kwargs = map_arg(node.kwargs, lambda a: narrowed_inputs.get(a, a))
        for location in dtype_locations:
            set_argument(node, location, INT16)
        node.meta["val"] = result
        return True
