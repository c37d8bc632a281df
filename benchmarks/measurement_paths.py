"""Calibration and the emulation node by node, against an instrumented copy run as compiled code.

    python -m benchmarks.measurement_paths [--repeats 9]

fx16 measures its verdicts by running the program node by node: calibration
(``MagnitudeRecorder``: one reduction per value) and the emulated 16-bit runs
(``Emulation``: each value rounded). The alternative, as PT2E's ``prepare`` inserts
observers, is a copy of the graph with an observer (or a rounding) node after each
value, recompiled once and run as Python code. This benchmark builds that copy for
the same values and times both paths on a small-op graph (GPT-2 stacks of width 128
on 32 tokens, the graphs of ``benchmarks/scaling.py``) and a large-op one (width 768
on 4 x 128 tokens). The copy here does the same work per value as fx16's paths (an
``aminmax`` per float tensor; a round trip through 16-bit), not all of calibration's
bookkeeping, so its times are a floor for a compiled path.

Columns: the forward of the exported module (compiled code), one run node by node,
the copy's one-off price (copy, instrument, recompile) and one run of it, each the
fastest of ``--repeats`` rounds in which the runs take turns; "break-even runs": how
many runs the copy needs before its saving per run pays its price (a cast runs
calibration once per calibration input and the emulation once per verdict question
plus once).
"""

import argparse
import time
import warnings

import torch
import torch.utils._pytree as pytree
from torch.fx import Graph, GraphModule, Node

from benchmarks.zoo import gpt2
from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.emulation import Emulation
from fx16.analysis.magnitudes import MagnitudeRecorder, observe_floats
from fx16.ops.kinds import OpKind, op_kind
from fx16.program import Program

_observed: dict[int, tuple] = {}
_emulating: dict = {}  # the emulation the rounding nodes serve, and their nodes by index


def _observe(index: int, value) -> None:
    """An observer node's call: what calibration reduces a float tensor to."""
    _observed[index] = observe_floats(value)


def _round(index: int, value):
    """A rounding node's call: the value as the emulation rounds it."""
    return _emulating["emulation"].rounded(_emulating["nodes"][index], value)


def instrumented(graph_module: GraphModule, emulation: Emulation | None) -> GraphModule:
    """A copy of ``graph_module``, recompiled, with an observer after each float value
    calibration reduces (every one but the results of data movement, which hold their
    input's values), or, given an ``emulation``, each value it rounds replaced by its
    rounding."""
    graph = Graph()
    copied: dict[Node, Node] = {}
    graph.output(graph.graph_copy(graph_module.graph, copied))
    if emulation is not None:
        _emulating.update(emulation=emulation, nodes={})
        for index, node in enumerate(
            n for n in graph_module.graph.nodes if n in emulation.rounding
        ):
            _emulating["nodes"][index] = node
            value = copied[node]
            with graph.inserting_after(value):
                made = graph.call_function(_round, (index, value))
            value.replace_all_uses_with(
                made, delete_user_cb=lambda user, made=made: user is not made
            )
        return GraphModule(graph_module, graph)
    for index, node in enumerate(graph_module.graph.nodes):
        val = node.meta.get("val")
        if node.op == "output" or not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        if node.op == "call_function" and op_kind(node) == OpKind.DATA_MOVEMENT:
            continue
        with graph.inserting_after(copied[node]):
            graph.call_function(_observe, (index, copied[node]))
    return GraphModule(graph_module, graph)


def measure(label: str, model, inputs, repeats: int) -> list[str]:
    ep = torch.export.export(model, inputs)
    program = Program.of(ep)
    CalibrationAnalysis(program)(ep.graph_module)  # the emulation reads what it saw
    graph_module = ep.graph_module
    flat = program.graph_inputs(inputs, {}, copy_buffers=True)
    recorder = MagnitudeRecorder(graph_module)
    emulation = Emulation(program, [(inputs, {})], torch.float16)
    prices, copies = {}, {}
    for name, rounding in (("calibration", None), ("emulation", emulation)):
        start = time.perf_counter()
        copies[name] = instrumented(graph_module, rounding)
        prices[name] = time.perf_counter() - start
    runs = {
        "forward": lambda: graph_module(*flat),
        "calibration": lambda: recorder.run(*flat),
        "emulation": lambda: emulation.outputs((inputs, {}), set()),
        "calibration copy": lambda: copies["calibration"](*flat),
        "emulation copy": lambda: pytree.tree_leaves(copies["emulation"](*flat)),
    }
    best = dict.fromkeys(runs, float("inf"))
    with torch.no_grad():
        for _ in range(repeats):  # the runs take turns, so a slow spell of the machine hits all
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
    forward, nodes = best["forward"], len(graph_module.graph.nodes)
    rows = []
    for name in ("calibration", "emulation"):
        node_by_node, compiled, price = best[name], best[f"{name} copy"], prices[name]
        saving = node_by_node - compiled
        even = f"{price / saving:.0f}" if saving > 0 else "never"
        rows.append(
            f"| {label} | {nodes} | {name} | {forward * 1e3:.1f} ms | "
            f"{node_by_node * 1e3:.1f} ms ({node_by_node / forward:.2f}x) | "
            f"{price * 1e3:.1f} ms ({price / forward:.2f}x) | "
            f"{compiled * 1e3:.1f} ms ({compiled / forward:.2f}x) | {even} |"
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cases = [
        ("GPT-2 x32, width 128, 32 tokens", gpt2(32), (torch.randint(0, 1024, (1, 32)),)),
        (
            "GPT-2 x4, width 768, 4 x 128 tokens",
            gpt2(4, width=768, heads=12),
            (torch.randint(0, 1024, (4, 128)),),
        ),
    ]
    print(
        "| graph | nodes | path | forward | node by node | copy's price | copy's run "
        "| break-even runs |"
    )
    print("|---" * 8 + "|")
    for label, model, inputs in cases:
        for row in measure(label, model, inputs, args.repeats):
            print(row, flush=True)


if __name__ == "__main__":
    main()
