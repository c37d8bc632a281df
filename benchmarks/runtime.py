"""What the cast program costs at run time: on a GPU under ``torch.compile``, and lowered
to ExecuTorch.

    python -m benchmarks.runtime cuda [--output FILE] [--small]
    python -m benchmarks.runtime executorch [--output FILE]

``executorch``: the small GPT-2 and Llama and a MobileNet-like CNN (``SmallCnn``),
as fp32, ``.half()``, fx16 (its default ``scalars="exact"``; ``scalars="rounded"``,
the values ExecuTorch computes anyway; and that without the stable rewrites, whose
power-of-two scales run outside XNNPACK) and coreai-opt programs, lowered with
``to_edge_transform_and_lower`` and the XNNPACK partitioner; counted: the delegate
calls, the ops left outside the delegate, the casts among them and those that cast a
constant (a weight, or a Python scalar ``to_edge`` made an fp32 tensor) on every call.

``cuda``:
for GPT-2, Llama and a Qwen2-MoE mixture of experts, built from configs with seeded
random weights (nothing is downloaded) and exported on the GPU, four programs:

- ``fp32``: the exported program as it is;
- ``.half()``: eager ``model.half()``, then exported;
- ``fx16``: ``fx16.cast_to_16_bit_precision(ep)`` on the fp32 program, its weights on
  the GPU (the cast's calibration and emulated runs run there too);
- ``coreai-opt 0.3.0``: ``coreai_opt.casting.cast_to_16_bit_precision(ep)`` likewise;
- for the MoE, ``fx16, routing="16-bit"``: fx16 with the router's gate, softmax and
  top-k cast too (the default keeps them fp32 so that rounding never changes which
  experts a token goes to): what that choice costs.

Each program's ``ep.module()`` goes through ``torch.compile`` (default mode); the first
call's time is the compile time. After ``--warmup`` calls of each, the programs take
turns in ``--rounds`` rounds of ``--calls`` calls, each timed with CUDA events; the
latency is the median of the rounds' medians (their range beside it), so a drift of
the clocks between programs cannot pass for a difference. Then the profiler reads what
5 calls of each ask of the GPU: the kernels (and copies) a call launches and the sum of
their run times ("GPU busy"), a figure free of the host's launch gaps. The error is
max |out - fp32| / max |fp32| over the logits. ``--small`` builds tiny models on the CPU without
``torch.compile``: a check that the script runs, not a measurement.

On a machine without the packages: coreai-opt needs ``torchao`` and ``pydantic``;
where pip cannot reach an index, carry their wheels (``pip download --no-deps``) and
install them with ``pip install --no-index --no-deps``.
"""

import argparse
import copy
import gc
import multiprocessing
import os
import platform
import statistics
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import date
from pathlib import Path

import torch
from torch.export.graph_signature import InputKind

from benchmarks.markdown import table_row
from benchmarks.zoo import Logits

TOOLS = ("fp32", ".half()", "fx16", "coreai-opt 0.3.0")
ROUTED = 'fx16, routing="16-bit"'  # the MoE's router computed 16-bit too


# (small, measured) shapes of each model
GPT2_SHAPES = (
    dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512),
    dict(n_layer=4, n_embd=768, n_head=12, vocab_size=50257),
)
LLAMA_SHAPES = (
    dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=6,
        vocab_size=32000,
        num_attention_heads=16,
        num_key_value_heads=4,
    ),
)
MOE_SHAPES = (  # a Llama's attention, with experts for its MLP
    dict(
        LLAMA_SHAPES[0],
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
    ),
    dict(
        LLAMA_SHAPES[1],
        num_hidden_layers=4,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=1408,
        num_experts=16,
    ),
)


def gpt2(small: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = GPT2_SHAPES[0 if small else 1]
    config = GPT2Config(**shape, n_positions=1024, use_cache=False, attn_implementation="eager")
    return Logits(GPT2LMHeadModel(config))


def llama(small: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = LLAMA_SHAPES[0 if small else 1]
    return Logits(LlamaForCausalLM(LlamaConfig(**shape, use_cache=False)))


def qwen2_moe(small: bool) -> torch.nn.Module:
    """Top-2 of ``num_experts`` routed experts per token beside a shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    shape = MOE_SHAPES[0 if small else 1]
    config = Qwen2MoeConfig(**shape, num_experts_per_tok=2, use_cache=False)
    return Logits(Qwen2MoeForCausalLM(config))


class SmallCnn(torch.nn.Module):
    """A MobileNet-like stack: depthwise and pointwise convolutions, batch norms, ReLU6."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        layers, channels = [], 3
        for out in (width, width * 2, width * 4):
            layers += [
                torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels),
                torch.nn.Conv2d(channels, out, 1),
                torch.nn.BatchNorm2d(out),
                torch.nn.ReLU6(),
                torch.nn.MaxPool2d(2),
            ]
            channels = out
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Linear(channels, classes)

    def forward(self, images):
        return self.head(self.features(images).mean((2, 3)))


MODELS = {"GPT-2": gpt2, "Llama": llama, "Qwen2-MoE": qwen2_moe}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def program(tool: str, model, ids, device) -> tuple[torch.export.ExportedProgram, float | None]:
    """The exported program of ``tool`` and the seconds its cast took (None: no cast)."""
    if tool == ".half()":
        return torch.export.export(copy.deepcopy(model).half(), (ids,)), None
    ep = torch.export.export(model, (ids,))
    if tool == "fp32":
        return ep, None
    options = {"routing": "16-bit"} if tool == ROUTED else {}
    if tool.startswith("fx16"):
        from fx16 import cast_to_16_bit_precision
    else:
        from coreai_opt.casting import cast_to_16_bit_precision
    _sync(device)
    start = time.perf_counter()
    cast_to_16_bit_precision(ep, **options)
    _sync(device)
    return ep, time.perf_counter() - start


def timed_calls_ms(function, ids, device, calls: int) -> float:
    """The median time of ``calls`` calls, in milliseconds (CUDA events on a GPU)."""
    times = []
    for _ in range(calls):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            function(ids)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            function(ids)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def prepare(name: str, tool: str, model, ids, reference, device, small: bool):
    """``tool``'s compiled program and its row so far (cast and compile time, error);
    a failure is a row, not a crash."""
    try:
        ep, cast_seconds = program(tool, model, ids, device)
        function = ep.module() if small else torch.compile(ep.module())
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = function(ids)
        _sync(device)
        compile_seconds = time.perf_counter() - start
        error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
        return function, dict(cast=cast_seconds, compile=compile_seconds, error=error)
    except Exception as failure:
        traceback.print_exc()
        return None, dict(failed=f"{type(failure).__name__}: {str(failure).splitlines()[0][:120]}")


def interleaved_latency(functions: dict, ids, device, args) -> dict[str, list[float]]:
    """Each program's median call time in each of ``--rounds`` rounds, the programs
    taking turns within a round, so that a drift of the GPU's clocks or the host's
    load reaches them all alike."""
    medians = {tool: [] for tool in functions}
    with torch.no_grad():
        for function in functions.values():
            for _ in range(args.warmup):
                function(ids)
        for _ in range(args.rounds):
            for tool, function in functions.items():
                medians[tool].append(timed_calls_ms(function, ids, device, args.calls))
    return medians


def gpu_work(function, ids, calls: int = 5) -> dict:
    """What one call asks of the GPU, read with the profiler over ``calls`` calls: the
    kernels (and copies) it launches and the sum of their run times in milliseconds.
    Unlike the latency, this leaves out the host's launch gaps and the clocks' drift."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            function(ids)
        torch.cuda.synchronize()
    work = [event for event in profiler.events() if event.device_type == DeviceType.CUDA]
    if not work:  # a profiler that sees no kernels (no CUPTI) gives no figure
        return {}
    busy_us = sum(event.time_range.elapsed_us() for event in work)
    return dict(kernels=len(work) / calls, busy_ms=busy_us / calls / 1e3)


def cells(name: str, tool: str, row: dict, half: dict) -> list[str]:
    if "failed" in row:
        return [name, tool, "", "", row["failed"], "", "", "", ""]
    cast = f"{row['cast']:.2f} s" if row["cast"] is not None else "-"
    ratio = f"{row['ms'] / half['ms']:.3f}x" if "ms" in half else ""
    error = f"{row['error']:.1e}" if tool != "fp32" else "-"
    latency = f"{row['ms']:.2f} ms ({row['low']:.2f}-{row['high']:.2f})"
    kernels, busy = "-", "-"
    if "busy_ms" in row:
        kernels = f"{row['kernels']:.0f}"
        busy = f"{row['busy_ms']:.2f} ms"
        if "busy_ms" in half:
            busy += f" ({row['busy_ms'] / half['busy_ms']:.3f}x)"
    return [name, tool, cast, f"{row['compile']:.0f} s", latency, ratio, kernels, busy, error]


def run_cuda(args) -> list[str]:
    device = torch.device("cpu" if args.small else "cuda")
    header = ["model", "program", "cast", "compile", "latency (rounds' range)", "vs .half()"]
    header += ["kernels per call", "GPU busy (vs .half())", "error vs fp32"]
    lines = [table_row(header), table_row(["---"] * len(header))]
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model = build(args.small).eval().to(device)
        ids = torch.randint(0, model.model.config.vocab_size, (args.batch, args.tokens))
        ids = ids.to(device)
        with torch.no_grad():
            reference = model(ids).float()
        tools = (*TOOLS, ROUTED) if name == "Qwen2-MoE" else TOOLS
        functions, rows = {}, {}
        for tool in tools:
            function, rows[tool] = prepare(name, tool, model, ids, reference, device, args.small)
            if function is not None:
                functions[tool] = function
        for tool, medians in interleaved_latency(functions, ids, device, args).items():
            rows[tool].update(ms=statistics.median(medians), low=min(medians), high=max(medians))
            if device.type == "cuda":
                try:
                    rows[tool].update(gpu_work(functions[tool], ids))
                except RuntimeError:  # the latency stands without it
                    traceback.print_exc()
        for tool, row in rows.items():
            print(name, tool, row, flush=True)
        half = rows[".half()"]
        lines += [table_row(cells(name, tool, row, half)) for tool, row in rows.items()]
        del model, rows, functions
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines


def lowered(ep, inputs: tuple, calls: int) -> dict:
    """Lower ``ep`` to ExecuTorch with the XNNPACK delegate, count what runs (delegate
    calls, ops left outside the delegate, casts of a constant, a weight or a scalar
    made a tensor, that run on every call), then run it in ExecuTorch's runtime in a
    child process (a program the runtime crashes on is a row, not the end of the run)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    # the IR check refused the exp2 of fx16's older stable rewrites; it passes now, and
    # stays off so that every program is lowered alike
    config = EdgeCompileConfig(_check_ir_validity=False)
    edge = to_edge_transform_and_lower(
        ep, partitioner=[XnnpackPartitioner()], compile_config=config
    )
    graph = edge.exported_program().graph
    nodes = [node for node in graph.nodes if node.op == "call_function"]
    delegated = [node for node in nodes if "executorch_call_delegate" in str(node.target)]
    outside = [
        node for node in nodes if node not in delegated and "getitem" not in str(node.target)
    ]
    casts = [node for node in outside if "to_dim_order_copy" in str(node.target)]
    constant_casts = [node for node in casts if node.args[0].op == "placeholder"]
    counts = dict(
        delegated=len(delegated),
        outside=len(outside),
        casts=len(casts),
        constants=len(constant_casts),
    )
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as child:
        try:
            ms, output = child.submit(_run, edge.to_executorch().buffer, inputs, calls).result()
        except BrokenProcessPool:
            return dict(counts, failed="the runtime crashed")
        except RuntimeError as failure:  # lowered, but the runtime refuses it
            return dict(counts, failed=str(failure).splitlines()[0])
    return dict(counts, ms=ms, output=output)


def _run(buffer: bytes, inputs: tuple, calls: int) -> tuple[float, torch.Tensor]:
    """The time of one call of the ExecuTorch program ``buffer`` in milliseconds, the
    smallest of 5 rounds' medians of ``calls`` calls each (after 3 untimed calls; a
    sub-millisecond call is at the mercy of the host, and the smallest median is the
    one it disturbed least), and its first output."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    runtime = _load_for_executorch_from_buffer(buffer)
    for _ in range(3):
        output = runtime.forward(inputs)[0]
    medians = []
    for _ in range(5):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            runtime.forward(inputs)
            times.append((time.perf_counter() - start) * 1e3)
        medians.append(statistics.median(times))
    return min(medians), output


ROUNDED = 'fx16, scalars="rounded"'
UNSTABILIZED = 'fx16, scalars="rounded", stabilize=False'
EXECUTORCH_PROGRAMS = ("fp32", ".half()", "fx16", ROUNDED, UNSTABILIZED, "coreai-opt 0.3.0")
FX16_OPTIONS = {
    "fx16": {},
    ROUNDED: {"scalars": "rounded"},
    UNSTABILIZED: {"scalars": "rounded", "stabilize": False},
}


def executorch_program(tool: str, model, inputs: tuple) -> tuple:
    """``tool``'s exported program and the inputs it takes."""
    if tool == ".half()":
        inputs = tuple(x.half() if x.is_floating_point() else x for x in inputs)
        return torch.export.export(copy.deepcopy(model).half(), inputs), inputs
    ep = torch.export.export(model, inputs)
    if tool in FX16_OPTIONS:
        from fx16 import cast_to_16_bit_precision

        cast_to_16_bit_precision(ep, **FX16_OPTIONS[tool])
    elif tool != "fp32":
        from coreai_opt.casting import cast_to_16_bit_precision

        cast_to_16_bit_precision(ep)
    # a cast program takes 16-bit images; ExecuTorch converts nothing at its inputs
    return ep, tuple(x.to(val.dtype) for x, val in zip(inputs, user_input_vals(ep)))


def user_input_vals(ep) -> list[torch.Tensor]:
    """The recorded value of each user input of ``ep``, in order."""
    placeholders = {node.name: node for node in ep.graph.nodes if node.op == "placeholder"}
    return [
        placeholders[spec.arg.name].meta["val"]
        for spec in ep.graph_signature.input_specs
        if spec.kind == InputKind.USER_INPUT
    ]


def run_executorch(calls: int, only: list[str] | None = None) -> list[str]:
    header = ["model", "program", "delegate calls", "ops outside", "casts outside"]
    header += ["casts of a constant", "latency", "vs fp32", "error vs fp32"]
    lines = [table_row(header), table_row(["---"] * len(header))]
    models = {
        "GPT-2": (lambda: gpt2(True), lambda: torch.randint(0, 512, (1, 16))),
        "Llama": (lambda: llama(True), lambda: torch.randint(0, 512, (1, 16))),
        "CNN": (SmallCnn, lambda: torch.randn(1, 3, 32, 32)),
    }
    for name, (build, example) in models.items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        model, inputs = build().eval(), (example(),)
        with torch.no_grad():
            reference = model(*inputs)
        reference = getattr(reference, "logits", reference).float()
        fp32_ms = None
        for tool in EXECUTORCH_PROGRAMS:
            try:
                row = lowered(*executorch_program(tool, model, inputs), calls)
                cells = [str(row[key]) for key in ("delegated", "outside", "casts", "constants")]
                if "failed" in row:
                    cells += [f"fails at run time: {row['failed']}", "", ""]
                else:
                    fp32_ms = row["ms"] if tool == "fp32" else fp32_ms
                    error = (row["output"].float() - reference).abs().max() / reference.abs().max()
                    cells.append(f"{row['ms']:.2f} ms")
                    cells.append(f"{row['ms'] / fp32_ms:.2f}x" if fp32_ms else "")
                    cells.append(f"{float(error):.1e}" if tool != "fp32" else "-")
            except Exception as failure:
                reason = f"{type(failure).__name__}: {str(failure).splitlines()[0][:80]}"
                cells = [reason] + [""] * (len(header) - 3)
            print(name, tool, cells, flush=True)
            lines.append(table_row([name, tool, *cells]))
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=["cuda", "executorch"])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--small", action="store_true", help="tiny models on the CPU")
    parser.add_argument("--models", nargs="*", help="executorch: only these (GPT-2, Llama, CNN)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if args.target == "executorch":
        title, lines = (
            "ExecuTorch with the XNNPACK delegate",
            run_executorch(args.calls, args.models),
        )
        intro = (
            f"Measured {date.today().isoformat()}, torch {torch.__version__}, ExecuTorch 1.5.1 "
            "(`pip install --no-deps executorch==1.5.1 ruamel.yaml flatbuffers tabulate` in "
            "a virtual environment beside torch): `python -m benchmarks.runtime executorch`, "
            f"the small shapes, batch 1, the XNNPACK partitioner; latency: the smallest of 5 "
            f"rounds' medians of {args.calls} calls in ExecuTorch's runtime (its Python "
            f"bindings, a child process per program) on {os.cpu_count()} CPU cores."
        )
    else:
        title, lines = "torch.compile on CUDA", run_cuda(args)
        where = "CPU (--small)" if args.small else torch.cuda.get_device_name()
        intro = (
            f"Measured {date.today().isoformat()} on {where}, torch {torch.__version__}, "
            f"Python {platform.python_version()}: `python -m benchmarks.runtime cuda "
            f"--calls {args.calls} --rounds {args.rounds}` "
            f"(batch {args.batch} x {args.tokens} tokens; latency: the median over "
            f"{args.rounds} rounds of each round's median of {args.calls} calls, the programs "
            "taking turns)."
        )
    text = "\n".join([f"## {title}", "", intro, "", *lines, ""])
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
