"""fx16 next to its peers on the benchmark zoo, in one run; writes benchmarks/RESULTS.md.

    python -m benchmarks.compare [--output benchmarks/RESULTS.md]

Per model and tool: success, max relative error against fp64, whether integer outputs
stay exact, whether inf/nan appear that fp32 does not have, weight bytes relative to
fp32, casts added, float ops left in fp32 and the time the tool takes (the median of
three casts for the tools that cast an ExportedProgram). Peers: coreai-opt
0.3.0 (cast_to_16_bit_precision), eager ``.half()``, eager ``torch.autocast`` on the CPU in
bf16, and onnxconverter-common's ``convert_float_to_float16`` run in onnxruntime. A peer
that is not installed, or fails, is reported as such.
"""

import argparse
import copy
import io
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils._pytree as pytree

import fx16
from benchmarks import zoo
from benchmarks.markdown import table_row, write_results
from fx16.program import Program
from fx16.program.stats import program_stats, relative_error

_REPEATS = 3  # casts timed per tool and model (the median is reported)


def models():
    generator = torch.Generator().manual_seed(11)
    ids = lambda: (torch.randint(0, 512, (1, 16), generator=generator),)  # noqa: E731
    floats = lambda *shape: lambda: (torch.randn(*shape, generator=generator),)  # noqa: E731
    yield "BERT", lambda: zoo.bert(2), ids
    yield "GPT-2", lambda: zoo.gpt2(2, width=64, vocab=512), ids
    yield "Llama", lambda: zoo.llama(2), ids
    yield "T5 encoder", lambda: zoo.t5_encoder(), ids
    yield "Whisper encoder", zoo.whisper_encoder, floats(1, 16, 64)
    yield "ViT", zoo.vit, floats(1, 3, 32, 32)
    yield "ResNet-style CNN", lambda: zoo.ResNetish().eval(), floats(1, 3, 16, 16)
    yield "LSTM tagger", lambda: zoo.LSTMTagger().eval(), ids
    yield "trap: squared sum", lambda: zoo.SquaredSum().eval(), floats(4, 16)
    yield "trap: exp of large logits", lambda: zoo.ExpLogits().eval(), floats(4, 16)
    yield (
        "trap: int16 hash",
        lambda: zoo.BucketHash(),
        lambda: (torch.randint(0, 1000, (2, 8), generator=generator),) * 2,
    )


@dataclass
class Row:
    ok: str
    error: str = ""
    exact: str = ""
    new_nonfinite: str = ""
    weights: str = ""
    casts: str = ""
    fp32_ops: str = ""
    seconds: str = ""


def _outcome(reference, outputs, fp32_outputs) -> tuple[str, str, str]:
    errors, exact, nonfinite = [], True, False
    for ref, out, base in zip(reference, outputs, fp32_outputs):
        if not isinstance(ref, torch.Tensor):
            continue
        if ref.is_floating_point():
            errors.append(relative_error(ref, out.double()))
            nonfinite |= bool((torch.isfinite(base) & ~torch.isfinite(out.double())).any())
        else:
            exact &= torch.equal(ref, out.to(ref.dtype))
    error = f"{max(errors):.1e}" if errors else "-"
    return error, ("yes" if exact else "NO"), ("YES" if nonfinite else "no")


def _ep_tool(cast):
    def run(model, args, ep, reference, fp32_outputs):
        before = program_stats(ep)
        seconds = []
        for _ in range(_REPEATS):  # each on a fresh copy; the time is the median
            cast_ep = copy.deepcopy(ep)
            start = time.perf_counter()
            cast(cast_ep)
            seconds.append(time.perf_counter() - start)
        seconds = statistics.median(seconds)
        after = program_stats(cast_ep)
        with torch.no_grad():
            outputs = pytree.tree_leaves(cast_ep.module()(*Program(cast_ep).adapt_call(args)[0]))
        return Row(
            "yes",
            *_outcome(reference, outputs, fp32_outputs),
            f"{after.weight_bytes / before.weight_bytes:.2f}" if before.weight_bytes else "-",
            str(max(after.casts - before.casts, 0)),
            str(after.ops_in(torch.float32)),
            f"{seconds * 1e3:.0f} ms",
        )

    return run


def _state_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _weight_ratio(before, after) -> str:
    return f"{_state_bytes(after) / _state_bytes(before):.2f}" if _state_bytes(before) else "-"


def _half(model, args, ep, reference, fp32_outputs):
    half = copy.deepcopy(model).half()
    half_args = [a.half() if a.is_floating_point() else a for a in args]
    with torch.no_grad():
        outputs = pytree.tree_leaves(half(*half_args))
    ratio = _weight_ratio(model, half)
    return Row("yes", *_outcome(reference, outputs, fp32_outputs), ratio, "-", "-", "-")


def _autocast(model, args, ep, reference, fp32_outputs):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = pytree.tree_leaves(model(*args))
    ratio = _weight_ratio(model, model)
    return Row("yes", *_outcome(reference, outputs, fp32_outputs), ratio, "-", "-", "-")


def _onnxconverter(model, args, ep, reference, fp32_outputs):
    import onnx
    import onnxruntime
    from onnxconverter_common import float16

    buffer = io.BytesIO()
    # Weights that require grad make the CPU SDPA pick a kernel whose output layout the
    # exporter's decomposition cannot view (T5); inference needs no grad.
    frozen = copy.deepcopy(model).requires_grad_(False)
    torch.onnx.export(frozen, args, dynamo=True, verbose=False).save(buffer)
    proto = onnx.load_from_string(buffer.getvalue())
    start = time.perf_counter()
    converted = float16.convert_float_to_float16(proto, keep_io_types=True)
    seconds = time.perf_counter() - start
    session = onnxruntime.InferenceSession(converted.SerializeToString())
    feed = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    outputs = [torch.from_numpy(o) for o in session.run(None, feed)]
    casts = sum(n.op_type == "Cast" for n in converted.graph.node) - sum(
        n.op_type == "Cast" for n in proto.graph.node
    )
    return Row(
        "yes",
        *_outcome(reference, outputs, fp32_outputs),
        "-",
        str(casts),
        "-",
        f"{seconds * 1e3:.0f} ms",
    )


def tools():
    found = {
        "fx16": _ep_tool(fx16.cast_to_16_bit_precision),
        "fx16 auto_mixed_conservative": _ep_tool(
            lambda ep: fx16.cast_to_16_bit_precision(ep, policy="auto_mixed_conservative")
        ),
        "fx16 auto_mixed_bf16": _ep_tool(
            lambda ep: fx16.cast_to_16_bit_precision(ep, policy="auto_mixed_bf16")
        ),
    }
    try:
        from coreai_opt.casting import cast_to_16_bit_precision

        found["coreai-opt 0.3.0"] = _ep_tool(cast_to_16_bit_precision)
    except ImportError:
        found["coreai-opt 0.3.0"] = None
    found["eager .half()"] = _half
    found["eager autocast bf16"] = _autocast
    found["onnxconverter-common fp16"] = _onnxconverter
    return found


COMMAND = "python -m benchmarks.compare"
HEADER = (
    "| model | tool | ok | max rel. error | ints exact | new inf/nan | weight bytes | "
    "casts added | fp32 ops | time |"
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    lines = [HEADER, "|" + "---|" * 10]
    for name, build, draw in models():
        torch.manual_seed(0)
        model, args = build(), draw()
        ep = torch.export.export(model, args)
        with torch.no_grad():
            fp32_outputs = [
                o.double() if o.is_floating_point() else o for o in pytree.tree_leaves(model(*args))
            ]
            reference = pytree.tree_leaves(
                copy.deepcopy(model).double()(
                    *[a.double() if a.is_floating_point() else a for a in args]
                )
            )
        for tool, run in tools().items():
            if run is None:
                row = Row("not installed")
            else:
                try:
                    row = run(model, args, ep, reference, fp32_outputs)
                except Exception as error:  # a peer's failure is a result
                    row = Row(f"failed: {type(error).__name__}")
            cells = [
                name,
                tool,
                row.ok,
                row.error,
                row.exact,
                row.new_nonfinite,
                row.weights,
                row.casts,
                row.fp32_ops,
                row.seconds,
            ]
            lines.append(table_row(cells))
            print(lines[-1], flush=True)
    notes = (
        'Weight bytes are relative to fp32; errors are against fp64; "new inf/nan" counts '
        'values that are finite in fp32 but not after the cast. "-": does not apply.'
    )
    write_results(options.output, "Benchmark results", COMMAND, notes, lines)


if __name__ == "__main__":
    main()
