"""Every precision-policy preset on a GPT-2-style model: casts, ops per dtype, bytes, error.

python -m benchmarks.policies [--layers 4]
"""

import argparse
import copy
import warnings

import torch

import fx16
from benchmarks.zoo import gpt2
from fx16.program import Program
from fx16.program.stats import relative_error
from fx16.report import report_of

PRESETS = [
    "default",
    "always_fp32",
    "always_fp16",
    "auto_mixed_conservative",
    "auto_mixed",
    "auto_mixed_bf16",
    "autocast",
]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, inputs = gpt2(args.layers), (torch.randint(0, 1024, (2, 32)),)
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
