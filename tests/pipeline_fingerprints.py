"""What the fp16 pipeline decides and writes for a fixed set of programs, as data.

``tests/data/pipeline_before_plan.json`` holds these fingerprints as the pipeline
computed them before the cast inserter was split into choice (``fx16.plan.precedence``)
and rewrite (``fx16.passes.fp16_rewrite``), and the accuracy search stopped re-running
the analyses; ``test_pipeline_unchanged.py`` checks the pipeline of today against it.
The fingerprints are kept per program as exported (by ``input_digest``): a recorded cast
applies to that program only, and a transformers release that exports a zoo model
otherwise adds a record, made by the pipeline that matched every earlier one. Add the
records of this environment's exports (recorded ones are never changed; delete one to
record it anew, only on purpose: a behaviour change a commit states), from the
repository root: ``PYTHONPATH=. python tests/pipeline_fingerprints.py``.

The programs: the benchmark zoo's small models (default options, one with an
accuracy budget) and random programs drawn with fixed seeds from the fuzzer's full
menu (higher-order ops, custom ops, decomposed and dynamic ones included).
"""

import hashlib
import json
import random
import sys
import warnings
from pathlib import Path

import torch

import fx16
from fx16.decisions import PRECISION
from fx16.program.subgraphs import nested_graph_modules
from fx16.testing.random_programs import VOCAB, RandomProgram
from fx16.testing.strategies import EXTREME_WEIGHTS, ProgramCase

GOLDEN = Path(__file__).parent / "data" / "pipeline_before_plan.json"
RANDOM_SEEDS = range(24)
# The fuzzer's menu when the random programs were recorded: a seed draws from this list,
# so ops added to the menu later change no recorded program.
RECORDED_MENU = (
    *("abs", "add", "amax", "arange", "autocast_bf16", "autocast_off", "avg_pool"),
    *("batch_norm", "bf16_buffer", "bucketed_index", "cat_slice", "clamp", "cond", "conv1d"),
    *("cube", "cumsum", "custom_dtype_argument", "dequantized_int8", "div", "exp"),
    *("explicit_fp32_norm", "extreme_weight", "flip", "fp16_buffer", "fp64_region", "full"),
    *("gelu", "int32_buffer", "layer_norm", "linear", "linear_other", "log", "log_softmax"),
    *("map", "masked_fill", "matmul", "max_pool", "maximum", "mean", "mul", "neg"),
    *("ones_like", "pow", "quantize_dequantize", "relu", "reshape_permute", "rsqrt"),
    *("scalar_add", "scalar_mul", "sigmoid", "sin", "softmax", "sqrt", "stack", "sub", "sum"),
    *("tanh", "to_bf16_and_back", "to_fp16_and_back", "transpose", "var", "where"),
    *("while_loop", "zeros_like", "embedding", "gather", "index_put", "index_select"),
    *("int_to_float", "int_add", "int_clamp", "int_cumsum", "int_mul", "int_remainder"),
    *("int_scalar_add", "int_scalar_mul", "int_sub", "int_sum", "int_where"),
)


def random_case(seed: int) -> ProgramCase:
    """A random program as the fuzzer draws them, from ``seed`` alone."""
    rng = random.Random(seed)
    width = rng.randint(2, 6)
    scalars = [0.5, 2.0, -3.0, 1e-3, 7e4, 1e38, 1e-8]
    steps = [
        (rng.choice(RECORDED_MENU), rng.randint(0, 20), rng.randint(0, 20), rng.choice(scalars))
        for _ in range(rng.randint(1, 8))
    ]
    weights = [rng.choice(EXTREME_WEIGHTS) for _ in range(rng.randint(0, 2))]
    scale = rng.choice([1.0, 30.0, 1e3])
    torch.manual_seed(seed)
    model = RandomProgram(width, steps, weights).eval()
    batch = rng.randint(3, 5)
    args = (torch.randn(batch, width) * scale, torch.randint(0, VOCAB, (batch, width)))
    return ProgramCase(model, args, rng.random() < 0.5, rng.random() < 0.5, scale)


def zoo_cases() -> dict:
    """name -> (build an exported program, cast options)."""
    from benchmarks import zoo

    def exported(build, inputs):
        def make():
            torch.manual_seed(0)
            return torch.export.export(build(), inputs())

        return make

    def ids():
        return (torch.randint(0, 512, (1, 16)),)

    return {
        "gpt2": (exported(zoo.gpt2, lambda: (torch.randint(0, 1024, (1, 16)),)), {}),
        "llama": (exported(zoo.llama, ids), {}),
        "bert": (exported(zoo.bert, ids), {}),
        "qwen2_moe": (exported(zoo.qwen2_moe, lambda: (torch.randint(0, 512, (1, 16)),)), {}),
        "massive_llama budget": (
            exported(zoo.massive_llama, lambda: (zoo.massive_ids(),)),
            {"max_rel_error": 0.01},
        ),
    }


def input_digest(ep: torch.export.ExportedProgram) -> str:
    """A digest of the code of every graph of the program as exported, before a cast:
    a recorded cast applies to that program only (another transformers release may
    export a zoo model with other nodes)."""
    code = "\n".join(module.code for module in nested_graph_modules(ep.graph_module))
    return hashlib.sha256(code.encode()).hexdigest()


def fingerprint(ep: torch.export.ExportedProgram) -> dict:
    """The code of every graph (a digest) and every decision's dtype and reason."""
    modules = nested_graph_modules(ep.graph_module)
    code = "\n".join(module.code for module in modules)
    decisions = {
        f"{index}.{node.name}": [str(node.meta[PRECISION].dtype), node.meta[PRECISION].reason.name]
        for index, module in enumerate(modules)
        for node in module.graph.nodes
        if PRECISION in node.meta
    }
    return {"code": hashlib.sha256(code.encode()).hexdigest(), "decisions": decisions}


def fingerprints(recorded: dict) -> dict:
    """``recorded`` (name -> input digest -> fingerprint) with the programs this
    environment exports added where they are not recorded yet; a recorded cast is never
    changed (to record one anew, delete it first)."""
    cases = {name: (make(), options) for name, (make, options) in zoo_cases().items()}
    cases.update({f"random {seed}": (random_case(seed).export(), {}) for seed in RANDOM_SEEDS})
    found = {name: dict(records) for name, records in recorded.items()}
    for name, (ep, options) in cases.items():
        records = found.setdefault(name, {})
        digest = input_digest(ep)
        if digest not in records:
            records[digest] = fingerprint(fx16.cast_fp32_to_fp16(ep, **options))
    return found


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    GOLDEN.parent.mkdir(exist_ok=True)
    recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    GOLDEN.write_text(json.dumps(fingerprints(recorded), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
