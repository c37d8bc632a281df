"""Running the int16 pipeline's stages on their own, for the int16 test modules."""

import torch

from fx16.decisions import INT_PRECISION
from fx16.pipelines import int16_passes, run_passes


def run_int16_stages(ep, upto: type, **options):
    """Run the int16 pipeline up to and including the stage of class ``upto``."""
    passes = int16_passes(ep, **options)
    stop = next(i for i, stage in enumerate(passes) if isinstance(stage, upto))
    run_passes(passes[: stop + 1], ep.graph_module)
    return passes[stop]


def int_decisions(ep) -> dict:
    return {
        node.name: node.meta[INT_PRECISION]
        for node in ep.graph_module.graph.nodes
        if INT_PRECISION in node.meta
    }


def narrowed(ep) -> set[str]:
    return {name for name, d in int_decisions(ep).items() if d.dtype == torch.int16}
