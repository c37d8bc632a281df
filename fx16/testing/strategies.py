"""Hypothesis strategies that build small random, valid exported programs."""

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import nn

from fx16.testing.random_programs import MENU, VOCAB, WELL_CONDITIONED, RandomProgram

FP32 = torch.finfo(torch.float32)

# Scalars that stress the rules: below the fp16 subnormal, just past fp16's max,
# infinity-like sentinels, infinities, fp32's extremes.
EXTREME_SCALARS = [
    1e-9,
    -1e-9,
    1e-30,
    7e4,
    -7e4,
    65504.0,
    1e38,
    -1e38,
    float("inf"),
    float("-inf"),
    FP32.min,
    FP32.max,
    0.0,
]

scalars = st.one_of(
    st.sampled_from(EXTREME_SCALARS),
    st.floats(min_value=-1e5, max_value=1e5, allow_nan=False, width=32),
)

ELEMENTWISE = ("mul", "add", "clamp_min", "masked_fill", "where", "div")


class RandomMLP(nn.Module):
    """Linear layers, each followed by one elementwise op with a drawn scalar."""

    def __init__(self, widths, ops, constants):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.ops, self.constants = ops, constants

    def extra_repr(self):
        return f"ops={self.ops}, constants={self.constants}"

    def forward(self, x):
        for layer, op, value in zip(self.layers, self.ops, self.constants):
            x = apply_elementwise(op, layer(x), value)
        return x


class RandomAttention(nn.Module):
    """Single-head attention with a drawn mask fill and a drawn score scale."""

    def __init__(self, width, fill, scale):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.fill, self.scale = fill, scale

    def extra_repr(self):
        return f"fill={self.fill}, scale={self.scale}"

    def forward(self, x, keep):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~keep[:, None, :], self.fill)
        return self.out(torch.softmax(scores, -1) @ v)


def apply_elementwise(op, x, value):
    if op == "mul":
        return x * value
    if op == "add":
        return x + value
    if op == "div":
        return x / value if value != 0 else x
    if op == "clamp_min":
        return x.clamp(min=value)
    if op == "masked_fill":
        return x.masked_fill(x > 0, value)
    return torch.where(x > 0, x, torch.full_like(x, value))


@st.composite
def mlp_cases(draw):
    depth = draw(st.integers(1, 3))
    widths = draw(st.lists(st.integers(1, 12), min_size=depth + 1, max_size=depth + 1))
    ops = draw(st.lists(st.sampled_from(ELEMENTWISE), min_size=depth, max_size=depth))
    constants = draw(st.lists(scalars, min_size=depth, max_size=depth))
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    model = RandomMLP(widths, ops, constants).eval()
    batch = draw(st.integers(1, 3))
    return model, (torch.randn(batch, widths[0]),)


@st.composite
def attention_cases(draw):
    width = draw(st.integers(2, 16))
    length = draw(st.integers(1, 6))
    fill = draw(scalars)
    scale = draw(st.sampled_from([1.0, 0.125, 1e-3, 100.0]))
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    model = RandomAttention(width, fill, scale).eval()
    keep = torch.rand(2, length) > 0.3
    keep[:, 0] = True
    return model, (torch.randn(2, length, width), keep)


model_cases = st.one_of(mlp_cases(), attention_cases())


# ---- integer programs ---------------------------------------------------------------

INT_STEPS = (
    "add",
    "sub",
    "mul",
    "neg",
    "abs",
    "remainder",
    "clamp",
    "cumsum",
    "sum",
    "maximum",
    "where",
    "scalar_add",
    "scalar_mul",
    "cat",
)


class RandomIntegerProgram(nn.Module):
    """A register machine over integer tensors: each step reads registers and appends one."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def extra_repr(self):
        return f"steps={self.steps}"

    def forward(self, a, b):
        registers = [a, b]
        for op, i, j, constant in self.steps:
            x, y = registers[i % len(registers)], registers[j % len(registers)]
            registers.append(integer_step(op, x, y, constant))
        return tuple(registers[2:]) or (a + b,)


def integer_step(op, x, y, constant):
    if op == "add":
        return x + y
    if op == "sub":
        return x - y
    if op == "mul":
        return x * y
    if op == "neg":
        return -x
    if op == "abs":
        return x.abs()
    if op == "remainder":
        return x % constant
    if op == "clamp":
        return x.clamp(-constant, constant)
    if op == "cumsum":
        return x.cumsum(-1)
    if op == "sum":
        return x.sum(-1, keepdim=True).expand_as(x)
    if op == "maximum":
        return torch.maximum(x, y)
    if op == "where":
        return torch.where(x > y, x, y)
    if op == "scalar_add":
        return x + constant
    if op == "scalar_mul":
        return x * constant
    return torch.cat([x, y], -1)[..., : x.shape[-1]]


@st.composite
def integer_cases(draw):
    """(model, args, input_ranges, draw_inputs): inputs are drawn inside the declared ranges."""
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(INT_STEPS),
                st.integers(0, 20),
                st.integers(0, 20),
                st.integers(1, 40000),
            ),
            min_size=1,
            max_size=6,
        )
    )
    ranges = {}
    for name in ("a", "b"):
        low = draw(st.integers(-40000, 40000))
        ranges[name] = (low, low + draw(st.integers(0, 40000)))
    width = draw(st.integers(1, 6))

    def inputs(seed):
        generator = torch.Generator().manual_seed(seed)
        return tuple(
            torch.randint(low, high + 1, (2, width), generator=generator, dtype=dtype)
            for low, high in ranges.values()
        )

    return RandomIntegerProgram(steps), inputs(0), ranges, inputs


# ---- programs from the whole op menu (fx16.testing.random_programs) ------------------------------

# Weight entries that stress the converters: past fp16's range, at its edge, below its
# subnormals.
EXTREME_WEIGHTS = [1e5, 7e4, -7e4, 65504.0, 1e-8, -1e-30, 3e38]


@dataclass
class ProgramCase:
    """A random program with its inputs; ``export()`` gives a fresh ExportedProgram."""

    model: nn.Module
    args: tuple
    dynamic: bool
    decompose: bool
    input_scale: float

    @property
    def input_ranges(self) -> dict:
        return {"ids": (0, VOCAB - 1)}

    def export(self) -> torch.export.ExportedProgram:
        shapes = None
        if self.dynamic:
            batch = torch.export.Dim("batch", min=2, max=16)
            shapes = ({0: batch}, {0: batch})
        if any(step[0] in ("cond", "while_loop", "map") for step in self.model.steps):
            torch._dynamo.reset()  # export compiles their bodies: start each from a clean cache
        ep = torch.export.export(self.model, self.args, dynamic_shapes=shapes)
        return ep.run_decompositions() if self.decompose else ep

    def inputs(self, seed: int) -> tuple:
        """Other inputs inside the declared ranges (same shapes)."""
        generator = torch.Generator().manual_seed(seed)
        x, ids = self.args
        return (
            torch.randn(x.shape, generator=generator) * self.input_scale,
            torch.randint(0, VOCAB, ids.shape, generator=generator),
        )


def sweep_cases(
    menu=tuple(MENU), steps_each: int = 8, width: int = 4, input_scale: float = 1.0
) -> list[ProgramCase]:
    """Programs that hold every entry of ``menu`` between them, ``steps_each`` to a
    program, each step reading the one before, on inputs of ``input_scale``: the ops a
    pass touches show in the programs it changes (``fx16.testing.fuzz_pass`` starts
    with them)."""
    cases = []
    for start in range(0, len(menu), steps_each):
        chunk = menu[start : start + steps_each]
        steps = [(name, index, index, 0.5) for index, name in enumerate(chunk)]
        torch.manual_seed(start)
        model = RandomProgram(width, steps, []).eval()
        args = (torch.randn(3, width) * input_scale, torch.randint(0, VOCAB, (3, width)))
        cases.append(ProgramCase(model, args, False, False, input_scale))
    return cases


@st.composite
def programs(draw, menu=tuple(MENU), max_steps: int = 8, extreme: bool = True):
    """Random programs over ``menu`` (default: every op), from default export or after
    ``run_decompositions()``, with a static or a dynamic batch dimension."""
    width = draw(st.integers(2, 6))
    step = st.tuples(st.sampled_from(menu), st.integers(0, 20), st.integers(0, 20), scalars)
    steps = draw(st.lists(step, min_size=1, max_size=max_steps))
    weights = draw(st.lists(st.sampled_from(EXTREME_WEIGHTS), max_size=3)) if extreme else []
    scale = draw(st.sampled_from([1.0, 30.0, 1e3])) if extreme else 1.0
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = RandomProgram(width, steps, weights).eval()
    batch = draw(st.integers(3, 5))  # export specializes a dynamic batch of 2 around cond
    args = (torch.randn(batch, width) * scale, torch.randint(0, VOCAB, (batch, width)))
    return ProgramCase(model, args, draw(st.booleans()), draw(st.booleans()), scale)


well_conditioned_programs = programs(menu=WELL_CONDITIONED, max_steps=6, extreme=False)
