"""The kernel rules: custom ops whose fake kernel refuses 16-bit inputs, and ATen ops with
no 16-bit kernel.
``fx16.analysis.fp32_rules`` runs them in order."""

from dataclasses import dataclass

import torch
from torch.fx import Node

from fx16.analysis.safety_rule import RuleContext
from fx16.decisions import Reason
from fx16.ops.tables import NO_LOW_KERNEL_OPS, is_custom_op
from fx16.program.propagation import runs_narrowed


@dataclass(frozen=True)
class FakeKernelRule:
    """A custom op whose fake kernel refuses ``low`` inputs (or that has none) keeps
    its inputs as exported: nothing can say what it computes on 16-bit values.

    Before: ``torch.ops.mylib.fused(x)`` registered for fp32 only fails on fp16 input.
    After: it reads fp32 inputs (cast up) and its result is cast back. Costs: the
    custom op's own FLOPs in fp32."""

    low: torch.dtype
    reason = Reason.NO_FAKE_KERNEL

    def applies(self, node: Node, context: RuleContext) -> str | None:
        custom = node.op == "call_function" and is_custom_op(node.target)
        return "" if custom and not runs_narrowed(node, self.low) else None


@dataclass(frozen=True)
class NoLowKernelRule:
    """An ATen op with no 16-bit kernel (``NO_LOW_KERNEL_OPS``: FFTs, factorizations,
    special functions) computes in fp32, as eager autocast runs it.

    Before: ``torch.fft.fftn(linear(x)).real`` cast to fp16 raises "Unsupported dtype
    Half" on the CPU, where the fp32 program runs. After: the linear stays 16-bit, the
    FFT reads its result cast up, and its readers take a 16-bit copy of what it gives.
    Costs: the op's own FLOPs in fp32, and one cast on each side."""

    reason = Reason.NO_LOW_KERNEL

    def applies(self, node: Node, context: RuleContext) -> str | None:
        return "" if node.op == "call_function" and node.target in NO_LOW_KERNEL_OPS else None
