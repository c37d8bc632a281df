"""Precision traps: fx16's default cast with the conditioning rule on and off, against fp64.

    python -m benchmarks.precision_traps [--qwen3]

Each trap runs at its largest inputs: a diffusers-style timestep embedding at t = 999
(int and float timesteps), a sinusoidal position table exported at seq = 16 with a
dynamic length up to 2048 and run at 2048, and rotary attention decoding at positions
1500-2040 after a prefill (sharp attention). ``--qwen3`` adds a small Qwen3 exported
for devices as transformers does it (static cache of 2048, torch.export's default
export), decoding at 1500-2040 after one prefill; its error is against the eager
fp32 module.
"""

import copy
import sys
import warnings

import torch

import fx16
from benchmarks.precision_zoo import (
    RotaryAttention,
    SinusoidalPositions,
    TimestepEmbedding,
    decode_outputs,
    rope_llm,
)
from fx16.program import Program
from fx16.program.stats import relative_error

RULE_OFF = fx16.PrecisionPolicy.custom(precision_tolerance=float("inf"))


def fp64_error(model, ep, *args) -> float:
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        want = model64(*[a.double() if a.is_floating_point() else a for a in args])
        got = ep.module()(*Program(ep).adapt_call(args)[0])
    return relative_error(want, got.double())


def timestep(dtype, policy) -> float:
    torch.manual_seed(0)
    model = TimestepEmbedding().eval()
    ep = torch.export.export(model, (torch.tensor([10, 500], dtype=dtype),))
    fx16.cast_fp32_to_fp16(ep, policy=policy)
    return fp64_error(model, ep, torch.tensor([999, 998], dtype=dtype))


def sinusoidal(policy) -> float:
    torch.manual_seed(0)
    model = SinusoidalPositions().eval()
    seq = torch.export.Dim("seq", min=2, max=2048)
    ep = torch.export.export(model, (torch.randn(1, 16, 64),), dynamic_shapes=({1: seq},))
    fx16.cast_fp32_to_fp16(ep, policy=policy)
    return fp64_error(model, ep, torch.randn(1, 2048, 64))


def rotary(policy) -> float:
    torch.manual_seed(0)
    model = RotaryAttention().eval()
    n = torch.export.Dim("n", max=2048)
    ep = torch.export.export(
        copy.deepcopy(model), (torch.randn(4, 64), torch.arange(4)), dynamic_shapes=({0: n}, {0: n})
    )
    fx16.cast_fp32_to_fp16(ep, policy=policy)
    errors = []
    for start in (1500, 1750, 2030):
        reference, cast = copy.deepcopy(model), copy.deepcopy(ep).module()
        generator = torch.Generator().manual_seed(start)
        prefill = torch.randn(start, 64, generator=generator)
        with torch.no_grad():
            reference(prefill, torch.arange(start))
            cast(prefill.half(), torch.arange(start))
            for position in range(start, min(start + 10, 2048)):
                x = torch.randn(1, 64, generator=generator)
                want = reference(x, torch.tensor([position]))
                got = cast(x.half(), torch.tensor([position])).float()
                errors.append(relative_error(want, got))
    return max(errors)


def qwen3(policy, sharpness: float) -> float:
    step = rope_llm("qwen3", sharpness=sharpness)
    example = {"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([0])}
    cast = fx16.cast_fp32_to_fp16(torch.export.export(step, (), example), policy=policy)
    return max(relative_error(want, got.float()) for want, got in decode_outputs(step, cast))


def main() -> None:
    warnings.simplefilter("ignore")
    traps = [
        ("timestep embedding, int t = 999", lambda p: timestep(torch.int64, p)),
        ("timestep embedding, float t = 999", lambda p: timestep(torch.float32, p)),
        ("sinusoidal table, exported at seq 16, run at 2048", sinusoidal),
        ("rotary attention (sharp), decode at 1500-2040", rotary),
    ]
    if "--qwen3" in sys.argv:
        for sharpness in (1.5, 2.0):
            traps.append(
                (
                    f"Qwen3 on-device export, q/k norm x{sharpness}, decode 1500-2040 (vs fp32)",
                    lambda p, s=sharpness: qwen3(p, s),
                )
            )
    print("| trap | fx16 default | conditioning rule off |")
    print("|---|---|---|")
    for name, trap in traps:
        print(f"| {name} | {trap(None):.2e} | {trap(RULE_OFF):.2e} |")


if __name__ == "__main__":
    main()
