"""ConvertUserInputsPass: fp32 user inputs become fp16 inputs."""

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.facts import Facts
from fx16.contracts import ALL
from fx16.decisions import PRECISION, Reason, decide
from fx16.passes.policy_pass import PolicyPass
from fx16.policy import Precision
from fx16.program.casts import WHY_NARROW, CastInserter, retype_val
from fx16.program.nodes import node_dtype


class ConvertUserInputsPass(PolicyPass):
    """Declare every fp32 user input 16-bit (the policy's dtype): callers pass 16-bit
    tensors afterwards. With the policy's ``keep_io_types``, the input stays fp32 and a
    cast right after it feeds the program instead.

    An input whose calibration values exceed ``65504 / overflow_margin``, that is
    named in ``force_fp32``, or that a safety rule keeps in fp32
    (``meta["fx16.fp32_rule"]``: a timestep feeding an ill-conditioned sin), stays fp32.

    Reads: the user-input placeholders and their ``meta["fx16.observed_range"]``.
    Writes: their ``meta["val"]`` and ``meta["fx16.precision"]``; the program's
    recorded example inputs, converted to match.
    """

    # it converts the user inputs; what the analyses found of the ops stays true
    preserves = ALL

    def call(self, graph_module: GraphModule) -> PassResult:
        casts = CastInserter(graph_module.graph)
        converted = modified = False
        for placeholder in self.program.user_input_placeholders():
            if node_dtype(placeholder) != torch.float32:
                continue
            rule = self.kept_fp32(placeholder)
            if rule is not None:
                placeholder.meta[PRECISION] = rule
                continue
            if meta.overflows(placeholder, self.limit):
                decide(placeholder, torch.float32, Reason.ACTIVATION_OVERFLOW)
                continue
            low = self.policy.low
            precision, entry = self.policy.matching_entry(placeholder)
            if precision != Precision.LOW:
                decide(placeholder, torch.float32, Reason.POLICY, detail=entry)
                continue
            if self.policy.keeps_io(placeholder.name):
                decide(placeholder, torch.float32, Reason.KEEP_IO)
                decide(casts.cast_after(placeholder, low, WHY_NARROW), low, Reason.FITS)
                modified = True
                continue
            placeholder.meta["val"] = retype_val(placeholder.meta["val"], low)
            decide(placeholder, low, Reason.FITS)
            converted = True
        if converted:
            self.program.adapt_example_inputs()
        Facts.invalidate(graph_module)  # nodes added, removed or rewired
        return PassResult(graph_module, converted or modified)
