"""The Core AI converter (coreai-torch) as a client of the cast programs.

    python -m benchmarks.coreai [--output benchmarks/COREAI.md]

Follows the flow the coreai-opt casting docs give: ``torch.export.export``, then
``run_decompositions(coreai_torch.get_decomp_table())``, then the 16-bit cast, then
``TorchConverter().add_exported_program(ep).to_coreai()`` and ``save_asset``. Per
model it reports whether the uncast program, coreai-opt 0.3.0's cast and fx16's
casts convert, and the share of f32 among the float tensor types in the converted
program's textual IR (``str(program)``). Where fx16 keeps more f32 than coreai-opt,
the rules its decision report gives for the fp32 ops are listed.
"""

import argparse
import collections
import copy
import re
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

import fx16
from benchmarks import zoo
from benchmarks.markdown import table_row, write_results
from fx16.report import decision_rows

# Element types of the tensor types in Core AI's textual IR: tensor<1x16xf32>, tensor<si16>.
_TENSOR_TYPE = re.compile(r"tensor<(?:[^<>]*x)?([a-z]+\d+)>")


def decompose(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program in the op set the converter takes."""
    import coreai_torch

    return ep.run_decompositions(coreai_torch.get_decomp_table())


def convert(ep: torch.export.ExportedProgram) -> collections.Counter:
    """Convert ``ep`` to a Core AI program, save it as an asset, and count the element
    types of the tensor types in its textual IR (``f16``, ``f32``, ``si16``, ...)."""
    import coreai_torch

    converter = coreai_torch.TorchConverter()
    converter.add_exported_program(ep)
    program = converter.to_coreai()
    with tempfile.TemporaryDirectory() as directory:
        program.save_asset(Path(directory) / "model.aimodel")
    return collections.Counter(_TENSOR_TYPE.findall(str(program)))


def f32_share(types: collections.Counter) -> float:
    """f32 among the float tensor types of a converted program."""
    floats = types["f32"] + types["f16"] + types["bf16"]
    return types["f32"] / floats if floats else 0.0


class MaskedAttention(nn.Module):
    """Single-head attention whose padding mask fills scores with fp32's lowest value."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.scale = width**-0.5

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(mask == 0, torch.finfo(torch.float32).min)
        return scores.softmax(-1) @ v


class Counters(nn.Module):
    """Integer arithmetic on tensors (int16-narrowable with declared ranges) feeding
    reshape-like ops, a scalar multiply, a reduction and an embedding lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 8)

    def forward(self, ids, counts):
        total = ids * counts + ids
        return (
            total.reshape(-1),
            (total * 2).view(2, -1),
            (ids - counts).flatten(),
            (total + counts).unsqueeze(0).permute(0, 2, 1),
            (ids + counts).cumsum(-1),
            self.embed(ids),
        )


def models():
    """(name, build, example inputs, input_ranges for the int16 cast) per model."""
    generator = torch.Generator().manual_seed(5)

    def randn(*shape):
        return (torch.randn(*shape, generator=generator),)

    ids = (torch.randint(0, 512, (1, 16), generator=generator),)
    mask = torch.ones(1, 8, 8, dtype=torch.int64).tril()
    small = torch.randint(0, 32, (2, 8), generator=generator)
    events = torch.randint(0, 3, (1, 64), generator=generator)
    yield "GPT-2", lambda: zoo.gpt2(2, width=64, vocab=512), ids, None
    yield "BERT", lambda: zoo.bert(2), ids, None
    yield "Llama", lambda: zoo.llama(2), ids, None
    yield "T5 encoder", zoo.t5_encoder, ids, None
    yield "ViT", zoo.vit, randn(1, 3, 32, 32), None
    yield "Whisper encoder", zoo.whisper_encoder, randn(1, 16, 64), None
    yield "ResNet-style CNN", zoo.ResNetish, randn(1, 3, 16, 16), None
    yield "LSTM tagger", zoo.LSTMTagger, ids, None
    yield "masked attention", MaskedAttention, (*randn(1, 8, 32), mask), None
    yield "trap: squared sum", zoo.SquaredSum, randn(4, 16), None
    yield "trap: exp of large logits", zoo.ExpLogits, randn(4, 16), None
    yield "int counters", Counters, (small, small.flip(0)), {"ids": (0, 31), "counts": (0, 31)}
    ranges = {"events": (0, 2), "weights": (1, 3)}
    yield "int running count", zoo.RunningCount, (events, events + 1), ranges


def casts(input_ranges):
    """name -> function casting a decomposed program in place."""
    found = {
        "uncast": lambda ep: ep,
        "fx16": fx16.cast_fp32_to_fp16,
        "fx16 16-bit": lambda ep: fx16.cast_to_16_bit_precision(ep, input_ranges=input_ranges),
    }
    try:
        from coreai_opt.casting import cast_to_16_bit_precision
    except ImportError:
        return found
    found["coreai-opt 0.3.0"] = cast_to_16_bit_precision
    return found


def fp32_rules(ep: torch.export.ExportedProgram) -> str:
    """The report's rules for the float ops fx16 kept in fp32, with counts."""
    counts = collections.Counter(
        row.rule for row in decision_rows(ep) if row.kind == "float" and row.dtype == "float32"
    )
    return ", ".join(f"{rule} ×{count}" for rule, count in counts.most_common()) or "-"


def measure(build, args, input_ranges) -> dict:
    """tool -> (converted types or the failure, the cast program)."""
    torch.manual_seed(0)
    model = build().eval()
    base = decompose(torch.export.export(model, args))
    results = {}
    for tool, cast in casts(input_ranges).items():
        ep = copy.deepcopy(base)
        try:
            cast(ep)
            results[tool] = (convert(ep), ep)
        except Exception as error:  # a failed conversion is a result
            results[tool] = (f"failed: {type(error).__name__}", ep)
    return results


def _cell(result) -> str:
    types, _ = result
    if isinstance(types, str):
        return types
    return f"yes, {f32_share(types):.0%} ({types['f32']} f32 / {types['f16']} f16)"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("COREAI.md"))
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    header = ["model"] + list(casts(None)) + ["si16 (fx16 16-bit)", "why fx16 keeps more f32"]
    lines = [table_row(header), "|" + "---|" * len(header)]
    for name, build, args, input_ranges in models():
        results = measure(build, args, input_ranges)
        cells = [name] + [_cell(result) for result in results.values()]
        fx16_types, fx16_ep = results["fx16 16-bit"]
        peer_types, _ = results.get("coreai-opt 0.3.0", ("", None))
        typed = not isinstance(fx16_types, str)
        cells.append(str(fx16_types["si16"]) if typed else "-")
        more = typed and not isinstance(peer_types, str) and peer_types
        more = more and f32_share(fx16_types) > f32_share(peer_types)
        cells.append(fp32_rules(fx16_ep) if more else "-")
        lines.append(table_row(cells))
        print(lines[-1], flush=True)
    notes = (
        "coreai-torch 0.4.3. Each cell: whether the program converts with "
        "`coreai_torch.TorchConverter` and saves as an asset, then the f32 share of the float "
        "tensor types in the converted IR. Programs are decomposed with "
        "`coreai_torch.get_decomp_table()` before the cast."
    )
    write_results(options.output, "Core AI conversion", "python -m benchmarks.coreai", notes, lines)


if __name__ == "__main__":
    main()
