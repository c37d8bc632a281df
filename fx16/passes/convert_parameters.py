"""ConvertParametersPass: fp32 parameters, buffers and tensor constants to fp16."""

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult

from fx16 import meta
from fx16.analysis.facts import Facts
from fx16.analysis.product_operands import only_product_operands
from fx16.contracts import ALL
from fx16.decisions import Reason, decide
from fx16.ops.numerics import (
    finite_interval,
    interval_below_normal,
    interval_may_flush,
    interval_overflows,
)
from fx16.passes.policy_pass import PolicyPass
from fx16.plan.graph_inputs import InputView, plan_state, record_rule
from fx16.plan.precedence import Action
from fx16.program.tensor_subclasses import (
    is_subclass,
    narrowed_state,
    narrowed_val,
    state_overflows,
)


class ConvertParametersPass(PolicyPass):
    """Store every fp32 state tensor that fits the policy's 16-bit dtype in it (fp16 by default).

    Reads: the program's parameters, buffers and tensor constants (lifted ones too).
    Writes: the converted tensors back into the program; their placeholders'
    ``meta["val"]``; ``meta["fx16.precision"]`` on every fp32 state placeholder.
    Inside a transaction (``Program.transaction``) plain tensors are only recorded
    (``Program.store_state``) and converted by its commit step, once every stage has
    decided; run on its own, the pass converts them before it returns.

    A tensor with a finite magnitude above 65504 stays fp32 (for bf16: above its maximum),
    and so does one whose every element lies below the 16-bit normal range (a weight of
    1e-9s, zeros in fp16: ``value_below_range``);
    where CalibrationAnalysis ran, its observed interval on the placeholder says so
    without reading the tensor again.
    A placeholder the policy keeps in fp32 (by kind "boundary", module path - the
    parameter's dotted name - or node name) stays fp32. Nonzero magnitudes
    below the smallest fp16 subnormal become +-2**-24 instead of zero, except in a
    tensor only matrix products, convolutions and attention read (``only_product_operands``: the
    nearest 16-bit value moves a product least, so it is rounded as ``.half()`` does,
    without the search for such elements). Tensors of
    other dtypes (int8 quantized weights, fp64, bf16, fp16) are left alone. A tensor
    stored under several names is converted once and shared again. Placeholders named
    in ``force_fp32``, or that a safety rule keeps in fp32 (``meta["fx16.fp32_rule"]``:
    a buffer such as a rotary ``inv_freq`` feeding an ill-conditioned sin), stay fp32.

    A tensor an earlier cast kept fp32 (a rule, or ``readers_fp32``: ``StoreAsReadPass``)
    stays so, with that decision: the ops reading it keep theirs, so a second cast finds
    what the first did.

    A tensor subclass of dtype fp32 (torchao's ``Int8Tensor``) is rebuilt with its fp32
    inner tensors (scales) in 16-bit and its quantized data untouched, where the
    subclass can be rebuilt so; otherwise it stays as it is (``subclass_kept``).

    A tensor stored under several names (tied weights) is stored once: where one name
    stays fp32 (a rule, the policy, the accuracy budget's fallback), every name does
    (``shared_fp32``), and the 16-bit ops reading it get a cast, rather than the
    program holding the tensor in both dtypes.
    """

    # it converts the state tensors; what the analyses found of the ops stays true
    preserves = ALL

    def call(self, graph_module: GraphModule) -> PassResult:
        rebuilt: dict[int, torch.Tensor] = {}  # subclass tensors, converted once per object
        fits: dict[int, tuple[bool, bool, bool]] = {}  # checked once per object (tied weights)
        modified = False
        low = self.policy.low
        slots = []
        for slot in self.program.state_slots():
            tensor = self.program.state_tensor(slot.target)
            if tensor is not None and self.program.state_dtype(slot.target) == torch.float32:
                slots.append((slot, tensor))

        def fit(placeholder, tensor):
            if id(tensor) not in fits:
                fits[id(tensor)] = _fit(placeholder, tensor, low)
            return fits[id(tensor)]

        views = [
            (
                InputView(
                    slot.placeholder,
                    self.policy,
                    self.limit,
                    self.kept_fp32(slot.placeholder),
                    slot.target,
                    lambda placeholder=slot.placeholder, tensor=tensor: fit(placeholder, tensor),
                ),
                id(tensor),
            )
            for slot, tensor in slots
        ]
        narrowing, details = [], {}
        for (slot, tensor), choice in zip(slots, plan_state(views)):
            record_rule(slot.placeholder, choice.rule)
            if choice.action == Action.LOW:
                narrowing.append((slot, tensor))
                details[slot.target] = choice.detail  # a folded bias says so
            else:
                decide(slot.placeholder, torch.float32, choice.reason, detail=choice.detail)
        boundaries = Facts.of(graph_module).boundaries
        product_operands = {}  # tensor id -> whether every name is read only by products
        for slot, tensor in narrowing:
            found = product_operands.get(id(tensor), True)
            product_operands[id(tensor)] = found and only_product_operands(
                slot.placeholder, boundaries
            )
        for slot, tensor in narrowing:
            may_flush = fits[id(tensor)][1] and not product_operands[id(tensor)]
            val = narrowed_val(slot.placeholder.meta["val"], low)
            if is_subclass(tensor):
                stored = rebuilt.get(id(tensor))
                if stored is None:
                    stored = narrowed_state(tensor, low)
                if stored is None or val is None:
                    decide(slot.placeholder, torch.float32, Reason.SUBCLASS_KEPT)
                    continue
                rebuilt[id(tensor)] = self.program.replace_state_tensor(slot.target, stored)
            else:
                self.program.store_state(slot.target, low, may_flush)
            slot.placeholder.meta["val"] = val
            decide(slot.placeholder, low, Reason.FITS, detail=details[slot.target])
            modified = True
        if not self.program.defers_state:
            self.program.commit_state()
        return PassResult(graph_module, modified)


def _fit(placeholder, tensor: torch.Tensor, low: torch.dtype) -> tuple[bool, bool, bool]:
    """Whether a finite element of the state tensor exceeds ``low``'s maximum, whether
    a nonzero element may flush to zero in ``low`` (``interval_may_flush``), and whether
    every element lies below its normal range (``interval_below_normal``: a weight of
    1e-9s would be zeros). Read from the interval calibration recorded on its
    placeholder when it ran (the same values: no second pass over the weights), else
    from the tensor."""
    if meta.holds_sentinel(placeholder):
        # a -1e38 would become -inf, and -inf - -inf is nan where -1e38 - -1e38 is 0
        return True, True, False
    interval = meta.observed_interval(placeholder)
    if interval is None and is_subclass(tensor):
        return state_overflows(tensor, low), True, False
    if interval is None:
        interval = finite_interval(tensor)
    return (
        interval_overflows(interval, low),
        interval_may_flush(interval, low),
        interval_below_normal(interval, low),
    )
