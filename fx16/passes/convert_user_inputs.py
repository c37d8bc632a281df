"""ConvertUserInputsPass: fp32 user inputs become fp16 inputs."""

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from fx16.analysis.facts import Facts
from fx16.contracts import ALL
from fx16.decisions import Reason, decide
from fx16.passes.policy_pass import PolicyPass
from fx16.plan.graph_inputs import USER_INPUT_RULES, InputView, record_rule
from fx16.plan.precedence import Action, choose
from fx16.program.casts import WHY_NARROW, CastInserter, retype_val
from fx16.program.nodes import node_dtype


class ConvertUserInputsPass(PolicyPass):
    """Declare every fp32 user input 16-bit (the policy's dtype): callers pass 16-bit
    tensors afterwards. With the policy's ``keep_io_types``, the input stays fp32 and a
    cast right after it feeds the program instead.

    An input whose calibration values exceed ``65504 / overflow_margin``, that is
    named in ``force_fp32``, or that a safety rule keeps in fp32
    (``meta["fx16.fp32_rule"]``: a timestep feeding an ill-conditioned sin), stays fp32:
    the choice is ``fx16.plan.graph_inputs.USER_INPUT_RULES``, which this pass applies.

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
            view = InputView(placeholder, self.policy, self.limit, self.kept_fp32(placeholder))
            choice = choose(USER_INPUT_RULES, view)
            record_rule(placeholder, choice.rule)
            low = self.policy.low
            if choice.action == Action.FP32:
                decide(placeholder, torch.float32, choice.reason, detail=choice.detail)
                continue
            if choice.action == Action.KEEP:  # keep_io_types: a cast after it feeds 16-bit
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
