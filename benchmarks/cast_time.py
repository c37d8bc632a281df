"""Cast time of fx16 and coreai-opt 0.3.0 on the same GPT-2-style program, in one process.

    python -m benchmarks.cast_time [--layers 32] [--repeats 3]

Builds GPT-2 from a ``transformers`` config with random weights (no download),
exports it once, and casts fresh copies with each tool. Prints the median time,
the ratio to fx16 and each result's max relative error against fp64.
"""

import argparse
import copy
import statistics
import time
import warnings

import torch

from benchmarks.peers import fp16_casts
from benchmarks.zoo import gpt2
from fx16.program.stats import relative_error


def measure(ep, cast, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        candidate = copy.deepcopy(ep)
        start = time.perf_counter()
        cast(candidate)
        times.append(time.perf_counter() - start)
        result = candidate
    return statistics.median(times), result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")

    torch.manual_seed(0)
    wrapped = gpt2(args.layers)
    inputs = (torch.randint(0, 1024, (1, 32)),)
    start = time.perf_counter()
    ep = torch.export.export(wrapped, inputs)
    export_seconds = time.perf_counter() - start
    nodes = len(ep.graph_module.graph.nodes)
    with torch.no_grad():
        reference = copy.deepcopy(wrapped).double()(*inputs)

    print(
        f"GPT-2 style, {args.layers} layers, {nodes} nodes; "
        f"torch.export took {export_seconds:.2f} s"
    )
    print(f"{'tool':24}{'cast time':>12}{'vs fx16':>10}{'max rel err':>14}")
    baseline = None
    for name, cast in fp16_casts().items():
        seconds, result = measure(ep, cast, args.repeats)
        baseline = baseline or seconds
        with torch.no_grad():
            error = relative_error(reference, result.module()(*inputs))
        print(f"{name:24}{seconds * 1e3:>10.0f}ms{seconds / baseline:>9.2f}x{error:>14.2e}")


if __name__ == "__main__":
    main()
