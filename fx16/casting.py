"""The public entry points, with the calling convention of ``coreai_opt.casting``."""

from torch.export import ExportedProgram

from fx16.pipelines import fp16_passes, run_passes
from fx16.program import Program


def cast_fp32_to_fp16(
    ep: ExportedProgram,
    *,
    keep_explicit_fp32: bool = True,
    calibration: list | None = None,
    overflow_margin: float = 2.0,
) -> ExportedProgram:
    """Rewrite ``ep`` in place to compute in fp16 where that is safe, and return it.

    Parameters, buffers, constants and user inputs become fp16 unless a value
    exceeds the fp16 range; ops run in fp16 unless an input or scalar forces fp32.
    Callers pass fp16 tensors for converted inputs afterwards, and outputs may be fp16.

    keep_explicit_fp32: keep the fp32 regions the model opens itself (``x.float()``,
        ``dtype=torch.float32``), such as the variance in an RMSNorm. False retargets
        those casts to fp16, as coreai-opt does.
    calibration: inputs to run the fp32 program on, a list of argument tuples (or
        ``(args, kwargs)`` pairs). Values that grow beyond the fp16 range on them
        (sums of squares, exp, attention scores) stay fp32. None: the example inputs
        torch.export recorded; []: no calibration.
    overflow_margin: a value counts as overflowing above ``65504 / overflow_margin``,
        since calibration inputs rarely show the largest values a model will see.

    Raises ``fx16.errors.InvalidProgramError`` for an argument that is not an
    ExportedProgram and ``fx16.errors.PassFailedError`` when a stage fails; in
    both cases ``ep`` is left exactly as it was.
    """
    program = Program(ep)
    with program.transaction():
        passes = fp16_passes(
            ep,
            keep_explicit_fp32=keep_explicit_fp32,
            calibration=calibration,
            overflow_margin=overflow_margin,
        )
        run_passes(passes, ep.graph_module)
    return ep
