"""Which integer nodes fx16 narrows to int16 on a few models, and why the others stay wide.

    python -m benchmarks.int16_table

Models: GPT-2 and BERT built from ``transformers`` configs (random weights, no
download) with a dynamic sequence length, a hashing bucketizer, and a running
counter. Each is cast with ``fx16.cast_to_16_bit_precision`` and the declared input
ranges shown; integer outputs are checked bit-exact against the original program.
"""

import warnings

import torch
import torch.utils._pytree as pytree

import fx16
from benchmarks.zoo import BucketHash, RunningCount, bert, gpt2
from fx16.program import Program
from fx16.report import format_rows
from fx16.report.rows import decision_rows


def transformer(kind: str):
    torch.manual_seed(0)
    model = gpt2(2, width=64) if kind == "gpt2" else bert(2)
    ids = torch.randint(0, 512, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 12:] = 0
    length = torch.export.Dim("length", max=128)
    dynamic_shapes = ({1: length}, {1: length})
    return model, (ids, mask), dynamic_shapes, {"input_ids": (0, 511)}


def cases():
    yield "GPT-2 (2 layers)", *transformer("gpt2")
    yield "BERT (2 layers)", *transformer("bert")
    ids = torch.randint(0, 1000, (4, 8))
    ranges = {"ids": (0, 999), "other": (0, 999)}
    yield "hash buckets", BucketHash(), (ids, ids.flip(0)), None, ranges
    length = torch.export.Dim("length", max=4096)
    events = torch.randint(0, 3, (1, 64))
    yield (
        "running count",
        RunningCount(),
        (events, events + 1),
        ({1: length}, {1: length}),
        {"events": (0, 2), "weights": (1, 3)},
    )


def main() -> None:
    warnings.simplefilter("ignore")
    for name, model, args, dynamic_shapes, input_ranges in cases():
        ep = torch.export.export(model, args, dynamic_shapes=dynamic_shapes)
        with torch.no_grad():
            expected = pytree.tree_leaves(ep.module()(*args))
        fx16.cast_to_16_bit_precision(ep, input_ranges=input_ranges)
        placeholders = Program(ep).user_input_placeholders()
        cast_args = [a.to(p.meta["val"].dtype) for a, p in zip(args, placeholders)]
        got = pytree.tree_leaves(ep.module()(*cast_args))
        exact = all(torch.equal(g, e) for g, e in zip(got, expected) if not e.is_floating_point())
        rows = [row for row in decision_rows(ep) if row.kind == "int"]
        narrowed = sum(row.narrowed for row in rows)
        print(
            f"\n## {name}: {narrowed} of {len(rows)} integer nodes narrowed; "
            f"input_ranges={input_ranges}; integer outputs exact: {exact}"
        )
        print(format_rows(rows))


if __name__ == "__main__":
    main()
