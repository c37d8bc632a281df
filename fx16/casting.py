"""The public entry points, with the calling convention of ``coreai_opt.casting``.

Each works in place, returns the program it was given, stores a CastReport in
``ep.graph_module.meta["fx16.report"]``, and is transactional: if a stage fails,
the program is restored and a ``PassFailedError`` names the stage.
"""

from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any, NoReturn

from torch.export import ExportedProgram

from fx16.accuracy.budget import cast_fp16_within_budget
from fx16.analysis.calibration_inputs import calibration_calls
from fx16.choices import DROP_IN_TARGET
from fx16.errors import InvalidOptionError, require_flag, require_number
from fx16.pipelines import fp16_passes, int16_passes, reject_unknown, run_passes
from fx16.plan.steps import explained
from fx16.policy import PrecisionPolicy, as_names
from fx16.policy.options import Fp16Options
from fx16.program import Program
from fx16.program.node_ids import assign_ids
from fx16.program.snapshot import collector_paused
from fx16.program.stats import record_stats_before
from fx16.report import REPORT_KEY, build_report, json_ready
from fx16.report.provenance import provenance
from fx16.report.saved import keep_decisions, restore_decisions


def cast_fp32_to_fp16(
    exported_program: ExportedProgram,
    ignored_ops: Any = None,
    *,
    policy: PrecisionPolicy | str | None = None,
    target: str | None = None,
    explicit_fp32: str | None = None,
    stabilize: bool | None = None,
    eps_clamp: bool | None = None,
    routing: str | None = None,
    range_fallback: str | None = None,
    keep_io_types: bool | Collection[str] | None = None,
    calibration: list | None = None,
    overflow_margin: float = 2.0,
    input_ranges: dict[str, tuple[int, int]] | None = None,
    force_fp32: Collection[str] | str = frozenset(),
    scalars: str = "exact",
    max_rel_error: float | None = None,
    target_share: float | None = None,
    metric: str | Callable | None = None,
    validation: list | None = None,
    progress: bool | None = None,
    **unknown: NoReturn,
) -> ExportedProgram:
    """Rewrite ``exported_program`` in place to compute in fp16 where that is safe, and return it.

    Parameters, buffers, constants and user inputs become fp16 unless a value
    exceeds the fp16 range; ops run in fp16 unless an input or scalar forces fp32.
    Callers pass fp16 tensors for converted inputs afterwards (``fx16.inputs_for``),
    and outputs may be fp16. A program made in bf16 is converted to fp16 with the
    same rules; one that computes in fp16 already, with nothing in fp32, is refused.

    Args:
        exported_program: the program, changed in place (positional or by name).
        ignored_ops: coreai-opt's option: ops kept in fp32, with casts at their boundary
            - an op (``torch.ops.aten.exp``: every overload; ``aten.exp.default``), a
            collection of them, or a predicate on a ``torch.fx.Node``. The report names
            the cause (``ignored_op``), apart from ``force_fp32``.
        policy: a ``fx16.PrecisionPolicy`` or a preset name ("auto_mixed_bf16", ...);
            default: everything in fp16 where safe (coreai-opt's behaviour, made safe).
        target: "cpu", "gpu" or "neural_engine": the settings whose trade depends on
            where it runs (``fx16.choices.TARGETS``: the Neural Engine's
            ``explicit_fp32="calibrated"``, a GPU's ``range_fallback="bf16"``); an
            explicit setting wins. None: the policy's settings.
        explicit_fp32: what becomes of the fp32 regions the model opens itself
            (``x.float()``, ``dtype=torch.float32``), such as the variance in an
            RMSNorm: "keep" keeps them all, as ``.half()`` does; "calibrated" keeps one
            only where the calibration inputs (with the margin), a proven range or the
            lack of any observation show 16-bit would spoil it (fewer fp32 ops, for the
            Neural Engine; a norm's statistic there computes to about fp32's accuracy);
            "retarget" casts them to fp16, as coreai-opt does. None: the policy's
            setting ("keep" by default).
        stabilize: rewrite patterns 16-bit spoils into forms exact in real arithmetic
            first (RMSNorm's variance scaled, log(softmax) as log_softmax, ...;
            ``fx16.passes.stabilize``), so they need no fp32 and hold on inputs the
            calibration never showed. None: the policy's setting (True, except
            autocast).
        eps_clamp: raise an ``eps`` below the 16-bit smallest normal to it; this
            changes results where the sum is below it. None: the policy's setting
            (False).
        routing: where the ops that choose a route compute (a mixture-of-experts
            router's top-k): "fp32" keeps them, "16-bit" casts them like the rest.
            None: the policy's setting ("fp32").
        range_fallback: where values fp16's range cannot carry compute, when no
            power-of-two scale carries them (logits a softmax reads unscaled): "fp32",
            or "bf16" for targets with both 16-bit dtypes (its range is fp32's; the
            report names each such op, its cause and "computed in bf16"). None: the
            policy's setting ("fp32").
        keep_io_types: keep user inputs and outputs in their original dtypes, with
            casts at the boundary (onnxconverter-common's option): True, or the names
            of the inputs and outputs to keep. None: the policy's setting (False).
        calibration: inputs to run the fp32 program on, a list of argument tuples (or
            ``(args, kwargs)`` pairs). Values that grow beyond the fp16 range on them
            (sums of squares, exp, attention scores) stay fp32. None: the example
            inputs torch.export recorded; []: no calibration.
        overflow_margin: a value counts as overflowing above ``65504 /
            overflow_margin``, since calibration inputs rarely show the largest values
            a model will see (a number >= 1).
        input_ranges: declared value ranges of integer user inputs, by name
            (``{"timestep": (0, 999)}``), as in ``cast_int32_to_int16``: floats made
            from them (``t.float()``) take their range from these, so the
            conditioning rule can tell a sin/cos of them is safe in fp16.
        force_fp32: names of nodes (as in ``exported_program.graph``) that must stay fp32, whatever
            the policy says; "output" returns outputs computed in fp32 as fp32.
        scalars: which Python numbers of 16-bit ops become 0-d 16-bit constants, so
            that ExecuTorch's ``to_edge`` casts no constant on every call: "exact"
            (the default: those the 16-bit type holds, every result bit for bit
            eager's), "rounded" (also those it rounds to a normal number, as
            ``to_edge``'s own cast would at run time), "keep" (none; see
            ``fx16.passes.ScalarsAsConstantsPass``).
        max_rel_error: an accuracy budget. After casting, outputs are compared with
            fp32 on the calibration inputs (max |diff| / max |fp32| per output); while
            over budget, the nodes that add the most error return to fp32 (see
            fx16.accuracy.budget). The search is recorded in the report's
            ``accuracy``.
        target_share: with ``max_rel_error``, the share of the budget the calibration
            error must reach, a margin for inputs not seen (0 < share <= 1). None:
            estimated from the calibration inputs: the plain cast is kept when its
            worst input is within the budget by as much as each input's error exceeds
            the others' (one input: the budget itself); a search aims at ``1 - 0.5 /
            sqrt(inputs)`` of it (its choices fit the calibration inputs).
        metric: with ``max_rel_error``, what the budget measures: "rel" (default: the
            largest relative error of any output), "cosine" (1 - cosine similarity),
            "top1" (the share of rows whose argmax differs), or a callable
            ``metric(reference_outputs, outputs) -> float``, lower is better, given one
            list of user outputs per input call for each program (see
            ``fx16.accuracy.metrics``).
        validation: with ``max_rel_error``, inputs the search never uses (a list like
            ``calibration``): the error on them is reported as the search's
            ``validation_error``, beside the calibration error.
        progress: show progress bars on stderr for the accuracy search and the weight
            conversion (None: only when stderr is a terminal).
        **unknown: none is accepted: an unknown keyword raises ``InvalidOptionError``
            (and a type checker flags it).

    Returns:
        ``exported_program`` itself, cast; its report is
        ``fx16.report.report_of(exported_program)``.

    Raises:
        fx16.InvalidProgramError: ``exported_program`` is not an ExportedProgram, or there is
            nothing to cast (it computes in fp16 already, with no fp32 value).
        fx16.InvalidOptionError: an unknown keyword, a malformed option, a name (in
            ``keep_io_types``, the policy's ``modules``/``nodes``/``ops``,
            ``force_fp32``) that names nothing in the program, or calibration inputs
            the program does not take or fails on.
        fx16.AccuracyBudgetError: ``max_rel_error`` cannot be met even with every node
            fx16 may return to fp32 in fp32.
        fx16.PassFailedError: a stage failed.

    Each leaves ``exported_program`` exactly as it was.
    """
    reject_unknown(cast_fp32_to_fp16, unknown)
    fp16_options = Fp16Options(**_fp16_fields(locals()))
    budget = dict(
        max_rel_error=max_rel_error, target_share=target_share, metric=metric, validation=validation
    )
    return _cast(exported_program, "cast_fp32_to_fp16", fp16_options, None, budget, progress)


def _fp16_fields(arguments: dict) -> dict:
    """The ``Fp16Options`` a public function takes, from its ``arguments`` (its locals)."""
    return {name: arguments[name] for name in Fp16Options.names()}


def cast_int32_to_int16(
    exported_program: ExportedProgram,
    *,
    input_ranges: dict | None = None,
    int16: str = "proven",
    calibration: list | None = None,
    **unknown,
) -> ExportedProgram:
    """Rewrite ``exported_program`` in place so integer computations run in int16 where
    nothing can wrap.

    Only the castable set is considered: integer values connected to an integer
    add/sub/mul on tensors, that depend on a user input and never flow into an
    index. Of those, a value is narrowed only when its range, and its inputs'
    ranges, are proven to fit int16 (from constants, shapes and ``range_constraints``,
    bounded ops and interval arithmetic) or follow from ``input_ranges``. Narrowed
    results are cast back to their original dtype, so outputs keep their dtypes;
    narrowed user inputs take int16 tensors afterwards.

    input_ranges: declared value ranges of integer user inputs, by name:
        ``{"input_ids": (0, 50256)}``. Ranges you declare are trusted.
    int16: "proven" (default) narrows only what provably fits; "observed" also
        trusts the ranges seen on ``calibration`` inputs (default: the example
        inputs), which inputs outside them can break; "assume_safe" narrows the whole
        castable set without checking ranges (what coreai-opt does: unchecked, values
        outside int16 wrap around); "off" does nothing.
    calibration: inputs for ``int16="observed"``, as in ``cast_fp32_to_fp16``.

    Raises like ``cast_fp32_to_fp16``, plus ``fx16.InvalidOptionError`` for a bad
    mode or an ``input_ranges`` name that is not a user input.
    """
    reject_unknown(cast_int32_to_int16, unknown)
    options = dict(input_ranges=input_ranges, int16=int16, calibration=calibration)
    return _cast(exported_program, "cast_int32_to_int16", None, options, {}, None)


def cast_to_16_bit_precision(
    exported_program: ExportedProgram,
    ignored_ops: Any = None,
    *,
    policy: PrecisionPolicy | str | None = None,
    target: str | None = None,
    explicit_fp32: str | None = None,
    stabilize: bool | None = None,
    eps_clamp: bool | None = None,
    routing: str | None = None,
    range_fallback: str | None = None,
    keep_io_types: bool | Collection[str] | None = None,
    calibration: list | None = None,
    overflow_margin: float = 2.0,
    input_ranges: dict[str, tuple[int, int]] | None = None,
    force_fp32: Collection[str] | str = frozenset(),
    scalars: str = "exact",
    int16: str = "proven",
    max_rel_error: float | None = None,
    target_share: float | None = None,
    metric: str | Callable | None = None,
    validation: list | None = None,
    progress: bool | None = None,
    **unknown: NoReturn,
) -> ExportedProgram:
    """fp32 -> fp16, then int32/int64 -> int16, in place and as one transaction.

    Args:
        exported_program: the program, changed in place (positional or by this name).
        ignored_ops: coreai-opt's option, as in ``cast_fp32_to_fp16``.
        target: as in ``cast_fp32_to_fp16``, but None with no ``policy`` is
            "neural_engine" (``fx16.choices.DROP_IN_TARGET``), where coreai-opt's users
            deploy: the model's own fp32 regions go 16-bit unless calibration shows they
            need fp32. ``target="cpu"``: ``cast_fp32_to_fp16``'s default.
        policy: as in ``cast_fp32_to_fp16``; so are ``explicit_fp32``, ``stabilize``,
            ``eps_clamp``, ``routing``, ``range_fallback``, ``keep_io_types``,
            ``overflow_margin``, ``force_fp32``, ``scalars``, ``max_rel_error``,
            ``target_share``, ``metric``, ``validation`` and ``progress``. The accuracy
            budget applies to the fp16 stage (int16 narrowing is exact).
        calibration: inputs for both stages: the fp16 stage's calibration, and the
            int16 stage's ``int16="observed"``.
        input_ranges: declared value ranges of integer user inputs, by name, for both
            stages (see ``cast_int32_to_int16``).
        int16: how integers narrow, as in ``cast_int32_to_int16``.
        **unknown: none is accepted: an unknown keyword raises ``InvalidOptionError``.

    Returns:
        ``exported_program`` itself, cast.

    Raises:
        fx16.Fx16Error: as ``cast_fp32_to_fp16`` and ``cast_int32_to_int16`` raise,
            leaving ``exported_program`` as it was.
    """
    reject_unknown(cast_to_16_bit_precision, unknown)
    if target is None and policy is None:
        target = DROP_IN_TARGET
    fp16_options = Fp16Options(**_fp16_fields(locals()))
    int16_options = dict(input_ranges=input_ranges, int16=int16, calibration=calibration)
    budget = dict(
        max_rel_error=max_rel_error, target_share=target_share, metric=metric, validation=validation
    )
    return _cast(
        exported_program, "cast_to_16_bit_precision", fp16_options, int16_options, budget, progress
    )


@collector_paused()
def _cast(ep, entry_point, fp16_options, int16_options, budget, progress) -> ExportedProgram:
    """Run the fp16 stage (searching within ``budget["max_rel_error"]`` if given), then
    the int16 stage, as one transaction, whose commit converts the weights; store the
    report. ``None`` options skip a stage."""
    program = Program.of(ep)
    require_flag("progress", progress)
    max_rel_error = budget.get("max_rel_error")
    if max_rel_error is not None:
        require_number("max_rel_error", max_rel_error, 0)
    else:
        for name in ("target_share", "metric", "validation"):
            if budget.get(name) is not None:
                raise InvalidOptionError(f"{name} needs max_rel_error")
    if fp16_options is not None:  # one name, or many
        fp16_options = replace(fp16_options, force_fp32=as_names(fp16_options.force_fp32))
    fp16_keywords = fp16_options.as_keywords() if fp16_options is not None else {}
    made_by = provenance(entry_point, {**fp16_keywords, **(int16_options or {}), **budget})
    restore_decisions(ep.graph_module)  # a cast program torch.export.load read: the first's
    before = record_stats_before(ep)
    assign_ids(ep.graph_module)  # before any change: fx16.diagnose aligns by them
    previous = ep.graph_module.meta.get(REPORT_KEY)
    accuracy = None
    with program.transaction(progress):
        if fp16_options is not None and max_rel_error is not None:
            accuracy = cast_fp16_within_budget(
                ep,
                max_rel_error,
                fp16_options.calibration,
                progress,
                budget["target_share"],
                fp16_options,
                budget["metric"],
                budget["validation"],
            )
        elif fp16_options is not None:  # one recompile for both stages, after the last
            last = int16_options is None
            run_passes(fp16_passes(ep, fp16_options), ep.graph_module, recompile=last)
        if int16_options is not None:
            run_passes(int16_passes(ep, **int16_options), ep.graph_module)
    if accuracy is None and previous is not None:  # a second cast keeps the first's search
        accuracy = previous.accuracy
    margin = fp16_options.overflow_margin if fp16_options is not None else 2.0
    # they survive torch.export.save
    keep_decisions(ep.graph_module, explained, json_ready(made_by), margin, accuracy)
    ep.graph_module.meta[REPORT_KEY] = replace(
        build_report(ep, before, accuracy, margin), provenance=made_by
    )
    return ep


def inputs_for(ep: ExportedProgram, *args, **kwargs) -> tuple[tuple, dict]:
    """A call's arguments as the cast program takes them: each tensor converted to the
    dtype its input has now (fp32 to fp16 where fx16 converted the input, int64 to int16
    where it narrowed one; token ids stay integers). Returns ``(args, kwargs)``::

        args, kwargs = fx16.inputs_for(ep, input_ids)
        logits = ep.module()(*args, **kwargs)

    Raises ``InvalidProgramError`` for a ``ep`` that is not an ExportedProgram and
    ``InvalidOptionError`` for arguments that do not supply the program's inputs.
    """
    program = Program.of(ep)
    (call,) = calibration_calls(program, [(args, kwargs)], label="inputs_for")
    return program.adapt_call(*call)
