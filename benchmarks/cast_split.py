"""Where the uncalibrated cast's time goes, stage by stage, next to one recompile.

    python -m benchmarks.cast_split [--layers 2 32] [--repeats 5]

Runs ``fx16.fp16_passes(ep, calibration=[])`` the way ``cast_fp32_to_fp16`` runs them
(one transaction, the root's code marked stale at the end, then the weights converted),
timing each pass, that marking and the weight conversion (the transaction's commit) apart
(``RecordStatsPass`` counts the program before the cast, which the public call does
just before its passes), next to the public call itself, which also gives the nodes
their ids and saves the decisions. Each figure is the fastest of ``--repeats`` casts of
fresh copies (each stage's fastest may come from another cast, so the stages' sum and
the whole call differ by this machine's noise), in µs per node of the exported graph.
"uncalibrated / 2 recompiles" in ``benchmarks/scaling.py`` asks the whole of it to fit
in two recompiles; the cast generates no code itself (the code is generated when first
needed, which that benchmark's "with its code" column adds).
"""

import argparse
import copy
import gc
import time
import warnings
from collections import defaultdict

import torch

import fx16
from benchmarks.zoo import gpt2
from fx16.program import Program
from fx16.program.lazy_code import compile_when_needed


def _staged_cast(ep) -> dict[str, float]:
    """Seconds per stage of one uncalibrated cast of ``ep``, in place."""
    seconds: dict[str, float] = {}
    with Program.of(ep).transaction():
        for pass_ in fx16.fp16_passes(ep, calibration=[]):
            start = time.perf_counter()
            pass_(ep.graph_module)
            seconds[type(pass_).__name__] = time.perf_counter() - start
        start = time.perf_counter()
        compile_when_needed(ep.graph_module)
        seconds["the root's code marked stale"] = time.perf_counter() - start
        start = time.perf_counter()  # the block ends: the commit converts the weights
    seconds["weights converted (commit)"] = time.perf_counter() - start
    return seconds


def _fastest(run, ep, repeats: int) -> dict[str, float]:
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    for _ in range(repeats):
        candidate = copy.deepcopy(ep)
        gc.collect()
        for stage, taken in run(candidate).items():
            best[stage] = min(best[stage], taken)
    return best


def _timed(action):
    def run(candidate) -> dict[str, float]:
        start = time.perf_counter()
        action(candidate)
        return {"": time.perf_counter() - start}

    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[2, 32])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    for layers in args.layers:
        torch.manual_seed(0)
        ep = torch.export.export(gpt2(layers), (torch.randint(0, 1024, (1, 32)),))
        nodes = len(ep.graph.nodes)
        stages = _fastest(_staged_cast, ep, args.repeats)
        uncalibrated = _timed(lambda candidate: fx16.cast_fp32_to_fp16(candidate, calibration=[]))
        whole = _fastest(uncalibrated, ep, args.repeats)
        recompile = _fastest(_timed(lambda c: c.graph_module.recompile()), ep, args.repeats)
        per_node = {stage: taken / nodes * 1e6 for stage, taken in stages.items()}
        print(f"\nGPT-2 x{layers}, {nodes} nodes: µs per node")
        print("| stage | µs/node |\n|---|---|")
        for stage, taken in sorted(per_node.items(), key=lambda item: -item[1]):
            print(f"| {stage} | {taken:.1f} |")
        print(f"| the stages' sum | {sum(per_node.values()):.1f} |")
        print(f"| **the whole cast, the public call** | **{whole[''] / nodes * 1e6:.1f}** |")
        print(f"| one recompile of the exported graph | {recompile[''] / nodes * 1e6:.1f} |")


if __name__ == "__main__":
    main()
