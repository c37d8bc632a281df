"""What a program computes when it runs, counted at the dispatcher, independently of
fx16's own cost model (``fx16.program.cost``): the matmul, convolution and attention
FLOPs by the dtype they compute in (torch's ``flop_counter`` formulas, with the CPU
attention kernel's), and the bytes that dtype conversions read and write.

    with RuntimeCount() as counted:
        Program(ep).run(args)
    counted.share_16bit, counted.cast_bytes
"""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _rnn_layer_flops(input, weight_ih, weight_hh, *_, out_val=None, **__) -> int:
    """One layer and direction of an fp32 LSTM on CPU (oneDNN's kernel): every step
    multiplies its input and its state by the weight matrices. (In 16-bit the LSTM runs
    as addmm steps, which torch's table counts.)"""
    steps = input.numel() // input.shape[-1]
    return 2 * steps * (weight_ih.numel() + weight_hh.numel())


def _linear_flops(x, weight, *_, out_val=None, **__) -> int:
    return 2 * (x.numel() // x.shape[-1]) * weight.numel()


def _matmul_flops(a, b, *_, out_val=None, **__) -> int:
    return 2 * out_val.numel() * a.shape[-1]


# the CPU flash-attention kernel takes the arguments of the CUDA one; an fp32 LSTM
# runs oneDNN's fused kernel, which torch's table does not list; inside a cond's branch
# linear and matmul arrive before they decompose
_FORMULAS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[
        aten._scaled_dot_product_flash_attention
    ],
    aten.mkldnn_rnn_layer: _rnn_layer_flops,
    aten.linear: _linear_flops,
    aten.matmul: _matmul_flops,
}
_CONVERSIONS = (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout)


class RuntimeCount(TorchDispatchMode):
    """Count, while active, the FLOPs of each product by its result's dtype and the
    bytes each dtype conversion moves (read and written); a cond runs the branch its
    predicate picks, counted."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.flops: Counter = Counter()
        self.cast_bytes = 0
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.higher_order.cond:
            predicate, if_true, if_false, operands = args
            with self:
                return (if_true if bool(predicate) else if_false)(*operands)
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(func._overloadpacket)
        if formula is not None:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.flops[first.dtype] += formula(*args, **kwargs, out_val=out)
        elif func in _CONVERSIONS:
            source = args[0]
            if isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor):
                if source.dtype != out.dtype:
                    self.casts += 1
                    self.cast_bytes += source.nbytes + out.nbytes
        return out

    @property
    def share_16bit(self) -> float | None:
        """The share of the products' FLOPs computed in 16-bit (None: no product ran)."""
        total = sum(self.flops.values())
        if not total:
            return None
        return sum(self.flops[dtype] for dtype in SIXTEEN_BIT) / total
