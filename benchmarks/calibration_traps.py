"""Activation overflow: fx16 with and without calibration, next to coreai-opt 0.3.0.

    python -m benchmarks.calibration_traps

Each model is exported once and cast by fx16 (default: calibrated on the example
inputs), fx16 with ``calibration=[]``, and coreai-opt's ``cast_fp32_to_fp16``.
Reported: max relative error against fp64 on the example input and on unseen inputs,
whether the output holds inf/nan, and the ops fx16 kept in fp32 for observed overflow.
"""

import copy
import warnings

import torch

from benchmarks.peers import fp16_casts
from benchmarks.zoo import ExpLogits, ScaledAttention, SquaredSum, gpt2
from fx16.program import Program
from fx16.program.stats import relative_error
from fx16.report import report_of


def cases():
    generator = torch.Generator().manual_seed(5)
    floats = lambda *shape: lambda: (torch.randn(*shape, generator=generator),)  # noqa: E731
    ids = lambda: (torch.randint(0, 512, (2, 16), generator=generator),)  # noqa: E731
    torch.manual_seed(0)
    yield "squared sum", SquaredSum().eval(), floats(4, 16)
    torch.manual_seed(0)
    yield "exp of large logits", ExpLogits().eval(), floats(4, 16)
    torch.manual_seed(0)
    yield "attention scores > 65504", ScaledAttention(16, scale=150.0).eval(), floats(2, 6, 16)
    torch.manual_seed(0)
    yield "GPT-2 (2 layers)", gpt2(2, width=64, vocab=512), ids


def error_on(model, ep, args) -> tuple[float, bool]:
    adapted = Program(ep).adapt_call(args)[0]
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(
            *[a.double() if a.is_floating_point() else a for a in args]
        )
        got = ep.module()(*adapted).double()
    return relative_error(reference, got), bool(torch.isfinite(got).all())


def main() -> None:
    warnings.simplefilter("ignore")
    print("| model | tool | error (example) | error (unseen) | finite | ops kept fp32 (overflow) |")
    print("|---|---|---|---|---|---|")
    for name, model, draw in cases():
        example, unseen = draw(), [draw() for _ in range(3)]
        ep = torch.export.export(model, example)
        for tool, cast in fp16_casts().items():
            try:
                result = cast(copy.deepcopy(ep))
            except Exception as error:  # a peer's crash is a result too
                print(f"| {name} | {tool} | failed: {type(error).__name__} | | | |")
                continue
            example_error, finite = error_on(model, result, example)
            unseen_error = max(error_on(model, result, args)[0] for args in unseen)
            report = report_of(result)
            kept = (
                ""
                if report is None
                else sum(row.rule == "activation_overflow" for row in report.rows)
            )
            print(
                f"| {name} | {tool} | {example_error:.2e} | {unseen_error:.2e} | "
                f"{finite} | {kept} |"
            )


if __name__ == "__main__":
    main()
