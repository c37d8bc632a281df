"""What ``fx16.diagnose`` costs on an LLM-sized program: time and peak extra memory.

    python -m benchmarks.diagnose_scale [--size 1.2B] [--tokens 8]

Builds the Llama-shaped program of ``benchmarks.llm_scale`` (seeded random weights),
casts a copy with fx16, then compares every value of the cast program with the fp32
one on one input of ``--tokens`` tokens. Prints the diagnosis time, the process's peak
resident set during it above what it held before (both programs already built), the
bytes of one full set of the fp32 program's activations (every value it computes,
summed: what holding one whole run would take), and the ratio of the two.
"""

import argparse
import copy
import gc
import time
import warnings

import torch

import fx16
from benchmarks.llm_scale import _reset_peak, _status, build, weight_bytes
from fx16.program.cost import tensor_bytes


def activation_bytes(ep, inputs) -> int:
    """Bytes of every value the program computes on ``inputs``, summed (from the shapes
    export recorded, scaled to the input's length)."""
    total = sum(
        tensor_bytes(node.meta.get("val"))
        for node in ep.graph_module.graph.nodes
        if node.op == "call_function"
    )
    exported_tokens = ep.example_inputs[0][0].shape[-1]
    return total * inputs[0].shape[-1] // exported_tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.2B")
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    model = build(args.size)
    ids = torch.randint(0, 1000, (1, args.tokens))
    reference = torch.export.export(model, (ids,))
    del model
    cast = fx16.cast_fp32_to_fp16(copy.deepcopy(reference))
    gc.collect()
    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    found = fx16.diagnose(reference, cast, [(ids,)])
    seconds = time.perf_counter() - start
    peak = _status("VmHWM") - before
    activations = activation_bytes(reference, (ids,))
    gib = 1 << 30
    print(
        f"| {args.size} | {args.tokens} tokens | {len(found.values)} values | "
        f"{weight_bytes(reference) / gib:.2f} GiB fp32 weights | {seconds:.1f} s | "
        f"peak extra {peak / gib:.3f} GiB | one set of activations {activations / gib:.3f} GiB "
        f"| {peak / activations:.2f}x |"
    )
    print("\n".join(found.summary()))


if __name__ == "__main__":
    main()
