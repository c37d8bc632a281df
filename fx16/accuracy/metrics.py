"""Accuracy metrics for the budget: how far a cast program's outputs are from fp32's.

A metric is a callable ``metric(reference_outputs, outputs) -> float``, lower is
better, 0 for identical outputs. Both arguments hold one entry per input call, each
the list of the program's user outputs (flattened, in order), so a metric can
aggregate over calls as it sees fit (an agreement rate over all rows, a worst case).
The presets, by name (``metric="top1"``, ``--metric top1``):

- ``rel``: the largest relative error of any float output on any call,
  max |cast - fp32| / max |fp32| (the default);
- ``cosine``: 1 - the smallest cosine similarity of a float output with fp32's on any
  call (each output flattened): for embeddings, where direction matters;
- ``top1``: the share of rows whose top-1 class differs from fp32's, over every call
  (argmax over the last dimension of the first float output): for classifiers and
  next-token logits.
"""

from collections.abc import Callable

import torch

from fx16.errors import InvalidOptionError
from fx16.program.nodes import is_float_tensor
from fx16.program.stats import outputs_error

Metric = Callable[[list, list], float]


def relative(reference: list, outputs: list) -> float:
    return max((outputs_error(ref, got) for ref, got in zip(reference, outputs)), default=0.0)


def cosine(reference: list, outputs: list) -> float:
    worst = 1.0
    for ref_call, got_call in zip(reference, outputs):
        for ref, got in zip(ref_call, got_call):
            if is_float_tensor(ref) and ref.numel():
                a, b = ref.double().flatten(), got.double().flatten()
                if not bool(torch.isfinite(b).all()):
                    return 1.0 if bool(torch.isfinite(a).all()) else worst
                similarity = torch.nn.functional.cosine_similarity(a, b, dim=0)
                worst = min(worst, float(similarity))
    return 1.0 - worst


def top1(reference: list, outputs: list) -> float:
    rows = differ = 0
    for ref_call, got_call in zip(reference, outputs):
        pair = next(((r, g) for r, g in zip(ref_call, got_call) if is_float_tensor(r)), None)
        if pair is None or pair[0].numel() == 0:
            continue
        ref, got = pair
        expected, found = ref.argmax(dim=-1), got.float().argmax(dim=-1)
        rows += expected.numel()
        differ += int((expected != found).sum())
    return differ / rows if rows else 0.0


# the same names as fx16.choices.METRIC_PRESETS, which the command line lists without torch
PRESETS: dict[str, Metric] = {"rel": relative, "cosine": cosine, "top1": top1}


def resolve(metric: "str | Metric | None") -> tuple[str, Metric]:
    """(name, callable) for a preset name, a callable, or None (``rel``)."""
    if metric is None:
        return "rel", relative
    if isinstance(metric, str):
        if metric not in PRESETS:
            raise InvalidOptionError(
                f"unknown metric {metric!r}; use one of {', '.join(PRESETS)} or a callable"
            )
        return metric, PRESETS[metric]
    if not callable(metric):
        raise InvalidOptionError(
            f"metric must be a preset name or a callable, not {type(metric).__name__}"
        )
    return getattr(metric, "__name__", "custom"), metric
