"""The Core AI converter (coreai-torch) as a client of the cast programs.

    python -m benchmarks.coreai [--output benchmarks/COREAI.md]

Follows the flow the coreai-opt casting docs give: ``torch.export.export``, then
``run_decompositions(coreai_torch.get_decomp_table())``, then the 16-bit cast, then
``TorchConverter().add_exported_program(ep).to_coreai()`` and ``save_asset``. Per
model it reports whether the uncast program, coreai-opt 0.3.0's cast and fx16's
casts convert, and the share of f32 among the float tensor types in the converted
program's textual IR (``str(program)``): every op left in f32 runs off the Neural
Engine. Then:

- the share fx16's precision rules account for: the f32 share of fx16's cast minus
  that of the same pipeline without ``ConditioningRule`` and ``UnsafeIndexRule``
  (RoPE angles, GELU's cube, T5's position buckets);
- the goal: without those, fx16's share is at most coreai-opt's + 0.02 wherever
  coreai-opt's output is correct (finite, and within ``TOLERANCE`` of fp32);
- fx16 with ``stabilize=False``: without the stable rewrites fx16 runs by default
  (``fx16.passes.stabilize``: the unstable patterns rewritten into forms that run in
  16-bit instead of fp32, RMSNorm's variance scaled), what they save;
- each cast program's error against the fp32 model (max |diff| / max |fp32| over the
  outputs), the mean over ``DRAWS`` inputs: the example, then inputs drawn like it (one
  input's figure moves by 1.3x from draw to draw); "non-finite" where it has inf or nan
  that fp32 does not;
- where fx16 keeps more f32 than coreai-opt, the rules its decision report gives.

fx16 casts for the Neural Engine: ``fx16 16-bit`` is ``cast_to_16_bit_precision`` as
coreai-opt's users call it (no target: ``"neural_engine"``, ``explicit_fp32="calibrated"``),
``fx16`` is ``cast_fp32_to_fp16`` with that target. The model's own fp32 regions (an
RMSNorm's statistic) are retargeted to 16-bit unless the calibration inputs show they need
fp32, the statistic computed to about fp32's accuracy. ``fx16 target=cpu`` keeps those
regions, as ``.half()`` does. The last error column is eager ``.half()``'s, the accuracy
the targets are held to.
"""

import argparse
import collections
import copy
import re
import tempfile
import warnings
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch import nn

import fx16
from benchmarks import zoo
from benchmarks.markdown import table_row, write_results
from fx16.analysis.fp32_rules import ConditioningRule, UnderflowRule, UnsafeIndexRule
from fx16.pipelines import run_passes, without_rules
from fx16.program import Program
from fx16.program.stats import relative_error
from fx16.report.rows import decision_rows

# Element types of the tensor types in Core AI's textual IR: tensor<1x16xf32>, tensor<si16>.
_TENSOR_TYPE = re.compile(r"tensor<(?:[^<>]*x)?([a-z]+\d+)>")

# An output within this relative error of fp32 counts as correct.
TOLERANCE = 1e-2
# How much more f32 than coreai-opt's fx16 may keep, precision rules aside.
GOAL = 0.02
PRECISION_RULES = (ConditioningRule, UnderflowRule, UnsafeIndexRule)
PEER = "coreai-opt 0.3.0"
UNSTABILIZED = "fx16, stabilize=False"
WITHOUT_PRECISION_RULES = "fx16 without precision rules"


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
    yield "Llama, massive activations", zoo.massive_llama, (zoo.massive_ids(),), None
    yield "T5 encoder, massive activations", zoo.massive_t5_encoder, (zoo.massive_ids(),), None
    step = (ids[0][:, :1], torch.tensor([0]))
    yield "Llama decoder, static KV cache", zoo.llama_decoder, step, None
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


# fx16's options for the Neural Engine, where every fp32 op leaves the accelerator.
NEURAL_ENGINE = {"target": "neural_engine"}
CPU = "fx16 target=cpu"


def casts(input_ranges):
    """name -> function casting a decomposed program in place."""
    found = {
        "uncast": lambda ep: ep,
        "fx16": lambda ep: fx16.cast_fp32_to_fp16(ep, **NEURAL_ENGINE),
        "fx16 16-bit": lambda ep: fx16.cast_to_16_bit_precision(ep, input_ranges=input_ranges),
        UNSTABILIZED: lambda ep: fx16.cast_fp32_to_fp16(ep, stabilize=False, **NEURAL_ENGINE),
        CPU: lambda ep: fx16.cast_to_16_bit_precision(ep, input_ranges=input_ranges, target="cpu"),
    }
    try:
        from coreai_opt.casting import cast_to_16_bit_precision
    except ImportError:
        return found
    found[PEER] = cast_to_16_bit_precision
    return found


def cast_without_precision_rules(ep: torch.export.ExportedProgram) -> None:
    """fx16's default pipeline with the precision rules taken out of Fp32RulesAnalysis."""
    passes = without_rules(fx16.fp16_passes(ep, **NEURAL_ENGINE), *PRECISION_RULES)
    with Program(ep).transaction():
        run_passes(passes, ep.graph_module)


def fp32_rules(ep: torch.export.ExportedProgram) -> str:
    """The report's rules for the float ops fx16 kept in fp32, with counts."""
    counts = collections.Counter(
        row.rule for row in decision_rows(ep) if row.kind == "float" and row.dtype == "float32"
    )
    return ", ".join(f"{rule} ×{count}" for rule, count in counts.most_common()) or "-"


def measure(build, args, input_ranges, only: set[str] | None = None) -> dict:
    """tool -> (converted types or the failure, the cast program), for each of
    ``casts`` and fx16 without its precision rules (``only``: just the tools named)."""
    torch.manual_seed(0)
    model = build().eval()
    strict = getattr(model, "strict_export", False)
    with torch.no_grad():
        base = decompose(torch.export.export(model, args, strict=strict))
    results = {}
    tools = {**casts(input_ranges), WITHOUT_PRECISION_RULES: cast_without_precision_rules}
    for tool, cast in tools.items():
        if only is not None and tool not in only:
            continue
        ep = copy.deepcopy(base)
        try:
            cast(ep)
            results[tool] = (convert(ep), ep)
        except Exception as error:  # a failed conversion is a result
            results[tool] = (f"failed: {type(error).__name__}", ep)
    return results


DRAWS = 64  # inputs each error is the mean over: the example, then ones drawn like it


def draws(args: tuple) -> list[tuple]:
    """``args``, then ``DRAWS - 1`` inputs drawn like it (seeded): floats from a standard
    normal of the same shape, integers uniform over the example's own range (from 0 to
    it where the example holds one number above 0, a decoder's one token: else every
    draw would be the example)."""
    generator = torch.Generator().manual_seed(17)

    def like(value):
        if not isinstance(value, torch.Tensor) or value.dtype == torch.bool:
            return value
        if value.is_floating_point():
            return torch.randn(value.shape, generator=generator, dtype=value.dtype)
        low, high = int(value.min()), int(value.max())
        low = min(low, 0) if low == high else low
        return torch.randint(low, high + 1, value.shape, generator=generator, dtype=value.dtype)

    return [args] + [tuple(like(value) for value in args) for _ in range(DRAWS - 1)]


def _draw_error(expected, got) -> float | str:
    """One input's error (the largest over the outputs), or what went wrong."""
    errors = []
    for want, have in zip(expected, got):
        if not want.is_floating_point():
            if not torch.equal(want, have.to(want.dtype)):
                return "integers differ"
            continue
        if (torch.isfinite(want) & ~torch.isfinite(have)).any():
            return "non-finite"
        errors.append(relative_error(want.double(), have.double()))
    return max(errors) if errors else "-"


def _mean_error(per_draw: list) -> str:
    """The mean of the draws' errors, or the first thing that went wrong."""
    wrong = next((error for error in per_draw if isinstance(error, str)), None)
    return wrong if wrong is not None else f"{sum(per_draw) / len(per_draw):.1e}"


def output_error(build, args, ep: torch.export.ExportedProgram) -> str:
    """The cast program's error against the fp32 model, the mean over ``draws(args)``:
    a number, "-" when it has only integer outputs (all exact), or what went wrong."""
    torch.manual_seed(0)
    model = build().eval()
    per_draw = []
    for call in draws(args):
        with torch.no_grad():
            expected = pytree.tree_leaves(model(*call))
        try:
            got = Program(ep).run(call)
        except Exception as error:  # a program that does not run is a result
            return f"fails: {type(error).__name__}"
        per_draw.append(_draw_error(expected, got))
    return _mean_error(per_draw)


def half_error(build, args) -> str:
    """Eager ``.half()``'s error against the fp32 model (as ``output_error``)."""
    torch.manual_seed(0)
    model = build().eval()
    half = copy.deepcopy(model).half()
    per_draw = []
    for call in draws(args):
        with torch.no_grad():
            expected = pytree.tree_leaves(model(*call))
            halves = [a.half() if a.is_floating_point() else a for a in call]
            try:
                got = pytree.tree_leaves(half(*halves))
            except Exception as error:  # a model .half() cannot run is a result
                return f"fails: {type(error).__name__}"
        per_draw.append(_draw_error(expected, got))
    return _mean_error(per_draw)


def _cell(result) -> str:
    types, _ = result
    if isinstance(types, str):
        return types
    return f"yes, {f32_share(types):.0%} ({types['f32']} f32 / {types['f16']} f16)"


def is_correct(error: str) -> bool:
    """An output error cell that is within TOLERANCE ("-": exact integers only)."""
    return error == "-" or (error[0].isdigit() and float(error) <= TOLERANCE)


def goal_cells(results: dict, errors: dict) -> list[str]:
    """The share fx16's precision rules account for, and whether fx16 without them
    keeps at most coreai-opt's share + GOAL (only where coreai-opt is correct)."""
    types, without = results["fx16"][0], results[WITHOUT_PRECISION_RULES][0]
    if isinstance(types, str) or isinstance(without, str):
        return ["-", "-"]
    rules = f"{f32_share(types) - f32_share(without):.2f}"
    peer = results.get(PEER, ("not installed",))[0]
    if isinstance(peer, str):
        return [rules, f"{f32_share(without):.2f} (coreai-opt: {peer})"]
    if not is_correct(errors[PEER]):
        return [rules, f"{f32_share(without):.2f}; coreai-opt's output is wrong"]
    verdict = "met" if f32_share(without) <= f32_share(peer) + GOAL else "MISSED"
    return [rules, f"{f32_share(without):.2f} vs {f32_share(peer):.2f}: {verdict}"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("COREAI.md"))
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    tools = list(casts(None))
    header = ["model", *tools, "fx16 f32 from precision rules", "goal: fx16 without them"]
    compared = [tool for tool in ("fx16", CPU, UNSTABILIZED, PEER) if tool in tools]
    header += [f"error vs fp32: {tool}" for tool in compared] + ["error vs fp32: .half()"]
    header += ["si16 (fx16 16-bit)", "why fx16 keeps more f32"]
    lines = [table_row(header), "|" + "---|" * len(header)]
    for name, build, args, input_ranges in models():
        results = measure(build, args, input_ranges)
        cells = [name] + [_cell(results[tool]) for tool in tools]
        errors = {tool: output_error(build, args, results[tool][1]) for tool in results}
        cells += goal_cells(results, errors)
        cells += [errors[tool] for tool in compared] + [half_error(build, args)]
        fx16_types, fx16_ep = results["fx16 16-bit"]
        peer_types, _ = results.get(PEER, ("", None))
        typed = not isinstance(fx16_types, str)
        cells.append(str(fx16_types["si16"]) if typed else "-")
        more = typed and not isinstance(peer_types, str) and peer_types
        more = more and f32_share(fx16_types) > f32_share(peer_types)
        cells.append(fp32_rules(fx16_ep) if more else "-")
        lines.append(table_row(cells))
        print(lines[-1], flush=True)
    notes = (
        "coreai-torch 0.4.3. Each tool's cell: whether the program converts with "
        "`coreai_torch.TorchConverter` and saves as an asset, then the f32 share of the float "
        "tensor types in the converted IR. Programs are decomposed with "
        "`coreai_torch.get_decomp_table()` before the cast. Precision rules: "
        "ConditioningRule and UnsafeIndexRule (their share: fx16's minus that of the same "
        "pipeline without them). Goal: fx16's share without them is at most coreai-opt's "
        f"+ {GOAL} wherever coreai-opt's output is correct (finite, error <= {TOLERANCE}). "
        f"Error: max |diff| / max |fp32|, the mean over {DRAWS} inputs (the example, then "
        "inputs drawn like it: floats standard normal, integers over the example's range). "
        "The massive-activation models scale their first layer so that two residual "
        "channels reach |x| ~ 2000, as trained LLMs do "
        "(`benchmarks.zoo.with_massive_activations`). fx16 rewrites the patterns 16-bit "
        "spoils into stable forms first (`fx16.passes.stabilize`; RMSNorm's variance scaled "
        "by the row's largest magnitude, to fp32's accuracy in a region the model opens), so "
        "their fp32 regions can run in 16-bit; `fx16, stabilize=False`: without those rewrites."
    )
    write_results(options.output, "Core AI conversion", "python -m benchmarks.coreai", notes, lines)


if __name__ == "__main__":
    main()
