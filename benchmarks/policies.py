"""Every precision-policy preset on a GPT-2-style model: casts, ops per dtype, bytes, error.

python -m benchmarks.policies [--layers 4]
"""

import argparse
import copy
import warnings

import torch

import fx16
from fx16.program import Program
from fx16.report import report_of
from fx16.stats import relative_error

PRESETS = [
    "default",
    "always_fp32",
    "always_fp16",
    "auto_mixed_conservative",
    "auto_mixed",
    "auto_mixed_bf16",
    "autocast",
]


def gpt2(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids).logits

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_embd=128,
        n_head=4,
        vocab_size=1024,
        n_positions=128,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Logits(GPT2LMHeadModel(config).eval()), (torch.randint(0, 1024, (2, 32)),)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    model, inputs = gpt2(args.layers)
    ep = torch.export.export(model, inputs)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(*inputs)
    print(f"GPT-2 style, {args.layers} layers; autocast = PrecisionPolicy.autocast('cpu', bf16)")
    print(
        "| policy | casts inserted | ops fp16 | ops bf16 | ops fp32 | weight bytes | "
        "max rel. error vs fp64 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in PRESETS:
        cast = fx16.cast_fp32_to_fp16(copy.deepcopy(ep), policy=name)
        report = report_of(cast)
        by_dtype = {}
        for row in report.rows:
            if row.kind == "float" and row.op != row.node:
                by_dtype[row.dtype] = by_dtype.get(row.dtype, 0) + 1
        with torch.no_grad():
            output = cast.module()(*Program(cast).adapt_call(inputs)[0])
        error = relative_error(reference, output)
        print(
            f"| {name} | {report.totals.casts_inserted} | {by_dtype.get('float16', 0)} | "
            f"{by_dtype.get('bfloat16', 0)} | {by_dtype.get('float32', 0)} | "
            f"{report.totals.weight_bytes_after} | {error:.2e} |"
        )


if __name__ == "__main__":
    main()
