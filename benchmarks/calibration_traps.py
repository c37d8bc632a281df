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

import fx16
from fx16.program import Program
from fx16.report import report_of
from fx16.stats import relative_error


class SquaredSum(torch.nn.Module):
    """A Linear whose outputs are squared and summed (an energy), then normalised."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 256)
        with torch.no_grad():
            self.fc.weight.mul_(40.0)

    def forward(self, x):
        h = self.fc(x)
        return h / h.pow(2).sum(-1, keepdim=True).sqrt()


class ExpLogits(torch.nn.Module):
    """exp of logits around 12 (e^12 > 65504), normalised by hand."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        with torch.no_grad():
            self.fc.bias.fill_(12.0)

    def forward(self, x):
        weights = self.fc(x).exp()
        return weights / weights.sum(-1, keepdim=True)


class HugeScores(torch.nn.Module):
    """Attention whose scores exceed 65504."""

    def __init__(self, width=16):
        super().__init__()
        self.q, self.k = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        with torch.no_grad():
            self.q.weight.mul_(150.0)
            self.k.weight.mul_(150.0)

    def forward(self, x):
        return (self.q(x) @ self.k(x).transpose(-1, -2)).softmax(-1) @ x


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=512,
        n_positions=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Logits(GPT2LMHeadModel(config).eval())


def cases():
    generator = torch.Generator().manual_seed(5)
    floats = lambda *shape: lambda: (torch.randn(*shape, generator=generator),)  # noqa: E731
    ids = lambda: (torch.randint(0, 512, (2, 16), generator=generator),)  # noqa: E731
    torch.manual_seed(0)
    yield "squared sum", SquaredSum().eval(), floats(4, 16)
    torch.manual_seed(0)
    yield "exp of large logits", ExpLogits().eval(), floats(4, 16)
    torch.manual_seed(0)
    yield "attention scores > 65504", HugeScores().eval(), floats(2, 6, 16)
    torch.manual_seed(0)
    yield "GPT-2 (2 layers)", gpt2(), ids


def tools():
    found = {
        "fx16": fx16.cast_fp32_to_fp16,
        "fx16, calibration=[]": lambda ep: fx16.cast_fp32_to_fp16(ep, calibration=[]),
    }
    try:
        from coreai_opt.casting import cast_fp32_to_fp16

        found["coreai-opt 0.3.0"] = cast_fp32_to_fp16
    except ImportError:
        pass
    return found


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
        for tool, cast in tools().items():
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
