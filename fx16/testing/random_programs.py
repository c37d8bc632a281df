"""A generator of random, valid programs for fuzzing: a register machine over tensors.

``RandomProgram`` holds float registers of shape (batch, width) and integer registers
of the same shape. Each step applies one operation from ``FLOAT_OPS`` or ``INT_OPS``
to registers it picks by index, with a drawn scalar, and appends the result. The menu
covers arithmetic, matmul, conv and pooling, norms, softmax, reductions,
exp/log/pow/rsqrt, comparisons with where/masked_fill, cat/stack/reshape/permute/slice,
writes in place into a cast's copy, into a cast's source and through an alias,
embedding/gather/index_select/index_put, creation ops, explicit casts, custom ops (an
activation quantize/dequantize pair, an op with a dtype argument), integer
arithmetic with cumsum and remainder, ``torch.cond``, ``while_loop``, ``map`` and
autocast regions, and reads fp16, bf16, int8 and int32 buffers and weights holding
values beyond fp16's range or below its subnormals. ``fx16.testing.strategies`` draws
programs from it.

Integer registers only ever hold values computed from integer inputs (a float turned
into an index is used at once), so integer outputs must stay bit-exact after a cast.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.while_loop import while_loop

import fx16.testing.custom_ops  # noqa: F401  (registers the fx16_test ops the menu calls)

VOCAB = 16


def _linear(m, x, y, c):
    return m.linears[0](x)


def _linear_other(m, x, y, c):
    return m.linears[1](x) + y


def _matmul(m, x, y, c):
    return (x.unsqueeze(-1) @ y.unsqueeze(-2)).mean(-1)


def _extreme_weight(m, x, y, c):
    return x @ m.extreme  # a weight holding values past fp16's range or below its subnormals


def _dequantized(m, x, y, c):
    return x @ (m.qweight.float() * m.qscale).t()


def _quantize_dequantize(m, x, y, c):
    """Activation quantization by custom ops: int8 codes, back in the scale's dtype."""
    codes = torch.ops.fx16_test.quantize(x, m.act_scale, torch.int8)
    return torch.ops.fx16_test.dequantize(codes, m.act_scale, torch.float32) + y


def _custom_dtype_argument(m, x, y, c):
    """A user's custom op whose dtype argument names its output type."""
    return torch.ops.fx16_test.scaled_to(x, c, torch.float32)


def _conv(m, x, y, c):
    return m.conv(x.unsqueeze(1)).squeeze(1)


def _avg_pool(m, x, y, c):
    return F.avg_pool1d(x.unsqueeze(1), 3, stride=1, padding=1).squeeze(1)


def _max_pool(m, x, y, c):
    return F.max_pool1d(x.unsqueeze(1), 3, stride=1, padding=1).squeeze(1)


def _explicit_fp32_norm(m, x, y, c):
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _index_put(m, x, y, ids, c):
    rows = torch.arange(x.shape[0])
    return x.index_put((rows, ids[:, 0] % x.shape[1]), y[:, 0])


def _bucketed(m, x, y, c):
    """A float turned into an index: bucket ids for an embedding lookup."""
    buckets = (x.abs() * 4).long().clamp(0, VOCAB - 1)
    return m.embed(buckets).mean(-1)


def _cond(m, x, y, c):
    # operands must not alias each other (y may be x, or a view of it), and torch 2.13's
    # export fails on a cond whose operand is a while_loop's result: both are copies
    operands = (x * 1.0, y * 1.0)
    return torch.cond(
        x.sum() > 0, lambda a, b: a * 2.0 + b, lambda a, b: (a - b).exp().clamp(max=1e3), operands
    )


def _while_loop(m, x, y, c):
    """A loop of 1 to 4 steps carrying a layer's state (the state must not alias x)."""
    steps = _count(c, 4)

    def condition(step, state):
        return step < steps

    def body(step, state):
        return step + 1, torch.tanh(m.linears[1](state)) * 2.0 + state * 0.5

    return while_loop(condition, body, (torch.tensor(0), x * 1.0))[1]


def _map(m, x, y, c):
    """A layer mapped over the rows of x, with a fresh tensor from y as the other operand.
    (x * 1.0: torch 2.13's export fails to map over a while_loop's result directly.)"""
    return hop_map(lambda row, other: m.linears[0](row).relu() * other, x * 1.0, y.mean(0) + 1.0)


def _autocast_off(m, x, y, c):
    with torch.autocast("cpu", enabled=False):
        energy = x.float().pow(2).sum(-1, keepdim=True)
    return x / (energy.sqrt() + 1e-3)


def _autocast_bf16(m, x, y, c):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = m.linears[0](x).relu()
    return h.float() + y


def _write_into_cast_copy(m, x, y, c):
    """A write in place into a cast's copy, then a read of the cast's source."""
    h = x.to(torch.float16)
    h.mul_(0.5)
    return x * 2.0 + h.float()


def _write_into_source(m, x, y, c):
    """A cast of a fresh value, a write in place into that value, then both read."""
    h = x * 1.0
    copied = h.to(torch.bfloat16)
    h.add_(y)
    return copied.float() - h


def _write_through_alias(m, x, y, c):
    """A conversion that changes nothing (the value itself), written through a view:
    the write shows in the value it aliases."""
    h = x * 1.0
    h.float().view(-1)[:1].mul_(0.5)  # halving: the write itself never overflows
    return h + y


def _safe_div(m, x, y, c):
    return x / (y.abs() + 1.0)


# name -> (function(module, x, y, scalar) -> float tensor): x and y are float registers.
FLOAT_OPS = {
    "add": lambda m, x, y, c: x + y,
    "sub": lambda m, x, y, c: x - y,
    "mul": lambda m, x, y, c: x * y,
    "div": _safe_div,
    "scalar_add": lambda m, x, y, c: x + c,
    "scalar_mul": lambda m, x, y, c: x * c,
    "neg": lambda m, x, y, c: -x,
    "abs": lambda m, x, y, c: x.abs(),
    "clamp": lambda m, x, y, c: x.clamp(-abs(c), abs(c)),
    "linear": _linear,
    "linear_other": _linear_other,
    "matmul": _matmul,
    "extreme_weight": _extreme_weight,
    "dequantized_int8": _dequantized,
    "quantize_dequantize": _quantize_dequantize,
    "custom_dtype_argument": _custom_dtype_argument,
    "conv1d": _conv,
    "avg_pool": _avg_pool,
    "max_pool": _max_pool,
    "layer_norm": lambda m, x, y, c: m.norm(x),
    "batch_norm": lambda m, x, y, c: m.batch_norm(x),
    "explicit_fp32_norm": _explicit_fp32_norm,
    "softmax": lambda m, x, y, c: x.softmax(-1),
    "log_softmax": lambda m, x, y, c: x.log_softmax(-1),
    "sum": lambda m, x, y, c: x.sum(-1, keepdim=True).expand_as(x),
    "mean": lambda m, x, y, c: x.mean(-1, keepdim=True) + y,
    "amax": lambda m, x, y, c: x.amax(-1, keepdim=True) - x,
    "var": lambda m, x, y, c: x.var(-1, keepdim=True).expand_as(x),
    "cumsum": lambda m, x, y, c: x.cumsum(-1),
    "exp": lambda m, x, y, c: x.exp(),
    "log": lambda m, x, y, c: (x.abs() + 1e-3).log(),
    "pow": lambda m, x, y, c: x.pow(2),
    "cube": lambda m, x, y, c: x.pow(3),
    "rsqrt": lambda m, x, y, c: (x.abs() + 1e-3).rsqrt(),
    "sqrt": lambda m, x, y, c: x.abs().sqrt(),
    "tanh": lambda m, x, y, c: x.tanh(),
    "sigmoid": lambda m, x, y, c: x.sigmoid(),
    "gelu": lambda m, x, y, c: F.gelu(x),
    "relu": lambda m, x, y, c: x.relu(),
    "sin": lambda m, x, y, c: x.sin() + y.cos(),
    "where": lambda m, x, y, c: torch.where(x > y, x, y),
    "masked_fill": lambda m, x, y, c: x.masked_fill(x > y, c),
    "maximum": lambda m, x, y, c: torch.maximum(x, y),
    "cat_slice": lambda m, x, y, c: torch.cat([x, y], -1)[:, 1 : x.shape[1] + 1],
    "stack": lambda m, x, y, c: torch.stack([x, y]).amax(0),
    "reshape_permute": lambda m, x, y, c: (
        x.unsqueeze(-1).expand(-1, -1, 2).permute(0, 2, 1).reshape(x.shape[0], -1)[:, 1::2]
    ),
    "transpose": lambda m, x, y, c: x.unsqueeze(-1).transpose(0, 1).squeeze(-1).t(),
    "flip": lambda m, x, y, c: x.flip(-1),
    "bucketed_index": _bucketed,
    "arange": lambda m, x, y, c: x + torch.arange(x.shape[1], dtype=torch.float32) * c,
    "full": lambda m, x, y, c: x + torch.full((x.shape[1],), c),
    "zeros_like": lambda m, x, y, c: torch.zeros_like(x) + x * 0.5,
    "ones_like": lambda m, x, y, c: torch.ones_like(x) * c,
    "to_fp16_and_back": lambda m, x, y, c: x.half().float(),
    "to_bf16_and_back": lambda m, x, y, c: x.bfloat16().float(),
    "fp64_region": lambda m, x, y, c: (x.double() * c).float(),
    "fp16_buffer": lambda m, x, y, c: x + m.half_bias,
    "bf16_buffer": lambda m, x, y, c: x * m.bf16_scale,
    "int32_buffer": lambda m, x, y, c: x + m.offsets,
    "cond": _cond,
    "while_loop": _while_loop,
    "map": _map,
    "autocast_off": _autocast_off,
    "autocast_bf16": _autocast_bf16,
    "write_into_cast_copy": _write_into_cast_copy,
    "write_into_source": _write_into_source,
    "write_through_alias": _write_through_alias,
}

# Ops that also read the integer register ``ids``.
FLOAT_OPS_WITH_IDS = {
    "embedding": lambda m, x, y, ids, c: m.embed(ids % VOCAB).mean(-1) + x,
    "gather": lambda m, x, y, ids, c: x.gather(-1, ids % x.shape[1]),
    "index_select": lambda m, x, y, ids, c: x.index_select(-1, ids[0] % x.shape[1]),
    "index_put": _index_put,
    "int_to_float": lambda m, x, y, ids, c: x + ids.float() * c,
}


def _count(c: float, limit: int) -> int:
    """A positive integer from the drawn float scalar (which may be inf or 1e38)."""
    magnitude = abs(c)
    return limit if magnitude != magnitude or magnitude >= limit else max(int(magnitude), 1)


# name -> function(a, b, scalar) -> integer tensor: a and b are integer registers.
INT_OPS = {
    "int_add": lambda a, b, c: a + b,
    "int_sub": lambda a, b, c: a - b,
    "int_mul": lambda a, b, c: a * b,
    "int_remainder": lambda a, b, c: a % _count(c, 97),
    "int_cumsum": lambda a, b, c: a.cumsum(-1),
    "int_clamp": lambda a, b, c: a.clamp(0, _count(c, 40_000)),
    "int_where": lambda a, b, c: torch.where(a > b, a, b),
    "int_scalar_add": lambda a, b, c: a + _count(c, 1000),
    "int_scalar_mul": lambda a, b, c: a * (_count(c, 1000) % 7),
    "int_sum": lambda a, b, c: a.sum(-1, keepdim=True).expand_as(a),
}

MENU = sorted(FLOAT_OPS) + sorted(FLOAT_OPS_WITH_IDS) + sorted(INT_OPS)

# Ops whose fp16 result stays within a few roundings of the fp32 one relative to the
# output's scale, on inputs of moderate size: no cancellation-prone ops (sub, var,
# layer_norm of nearly constant rows), no exponential ones.
WELL_CONDITIONED = (
    "add",
    "mul",
    "linear",
    "linear_other",
    "conv1d",
    "avg_pool",
    "max_pool",
    "softmax",
    "mean",
    "tanh",
    "sigmoid",
    "gelu",
    "relu",
    "maximum",
    "cat_slice",
    "stack",
    "reshape_permute",
    "transpose",
    "flip",
    "embedding",
    "gather",
    "index_select",
    "int_add",
    "int_cumsum",
)


class RandomProgram(nn.Module):
    """Runs ``steps``: (op name, first register, second register, scalar)."""

    def __init__(self, width: int, steps, extreme_values) -> None:
        super().__init__()
        self.steps = steps
        self.linears = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.conv = nn.Conv1d(1, 1, 3, padding=1)
        self.norm = nn.LayerNorm(width)
        self.batch_norm = nn.BatchNorm1d(width)
        self.embed = nn.Embedding(VOCAB, width)
        extreme = torch.randn(width, width) * 0.1
        extreme.view(-1)[: len(extreme_values)] = torch.tensor(extreme_values[: width * width])
        self.extreme = nn.Parameter(extreme)
        self.register_buffer("half_bias", torch.randn(width).half())
        self.register_buffer("bf16_scale", torch.rand(width).bfloat16() + 0.5)
        self.register_buffer("offsets", torch.arange(width, dtype=torch.int32))
        self.register_buffer("qweight", torch.randint(-127, 128, (width, width), dtype=torch.int8))
        self.register_buffer("qscale", torch.tensor(0.01))
        self.register_buffer("act_scale", torch.tensor(0.05))

    def extra_repr(self) -> str:
        return f"steps={self.steps}"

    def forward(self, x, ids):
        floats, ints = [x], [ids]
        for op, i, j, c in self.steps:
            a, b = floats[i % len(floats)], floats[j % len(floats)]
            if op in FLOAT_OPS:
                floats.append(FLOAT_OPS[op](self, a, b, c))
            elif op in FLOAT_OPS_WITH_IDS:
                floats.append(FLOAT_OPS_WITH_IDS[op](self, a, b, ints[j % len(ints)], c))
            else:
                ints.append(INT_OPS[op](ints[i % len(ints)], ints[j % len(ints)], c))
        # every register is an output, so no step is dead code
        return (*(floats[1:] or [x * 1.0]), *(ints[1:] or [ids + 0]))
