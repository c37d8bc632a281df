"""The pass lists behind the public entry points, and the runner they share.

Each call builds fresh pass instances bound to one program, so a list can be
handed to ``torch.fx.passes.infra.pass_manager.PassManager`` as it is, or edited
(reordered, extended with a user's own passes) first.
"""

import inspect
from dataclasses import replace

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase

from fx16.analysis import (
    CalibrationAnalysis,
    CastableInt16Analysis,
    ConditioningAnalysis,
    ExplicitFp32Analysis,
    Fp32RulesAnalysis,
    RoutingAnalysis,
    ScaleDomainsAnalysis,
    UnderflowAnalysis,
    UnsafeIndexAnalysis,
    UserReachabilityAnalysis,
    ValueRangeAnalysis,
    VerdictCheckAnalysis,
)
from fx16.analysis.facts import Facts
from fx16.contracts import forget_unpreserved
from fx16.decisions import PRECISION
from fx16.errors import (
    Fx16Error,
    InvalidOptionError,
    InvalidProgramError,
    PassFailedError,
    require_flag,
    require_number,
)
from fx16.meta import cast_by_fx16
from fx16.passes import (
    CleanupCastsPass,
    ConvertIntInputsPass,
    ConvertParametersPass,
    ConvertUserInputsPass,
    InsertFP16CastsPass,
    InsertInt16CastsPass,
    PreserveCopiesPass,
    RangeFallbackPass,
    RecastAfterWritesPass,
    RecordStatsPass,
    ScalarsAsConstantsPass,
    ScaleDomainsPass,
    SentinelFillsPass,
    SentinelSumsPass,
    StabilizePass,
    StoreAsReadPass,
    WidenOtherSixteenBitPass,
)
from fx16.passes.policy_pass import overflow_limit
from fx16.passes.widen_other_sixteen_bit import OTHER_SIXTEEN_BIT, made_in
from fx16.plan.narrowing import check_mode
from fx16.policy import PrecisionPolicy, as_names, resolve_policy
from fx16.policy.options import Fp16Options
from fx16.program import Program
from fx16.program.boundaries import Boundaries
from fx16.program.lazy_code import compile_when_needed
from fx16.program.names import check_names
from fx16.program.nodes import SIXTEEN_BIT_DTYPES, dtype_name, node_val, tensor_leaves
from fx16.program.subgraphs import nested_graph_modules
from fx16.stages import Fp16Stages

FP32 = torch.float32


def fp16_passes(ep, options: Fp16Options | None = None, **keywords) -> list[PassBase]:
    """The fp32 -> fp16 pipeline for ``ep``, as fresh pass instances.

    Order: a program made in the other 16-bit dtype (a bf16 checkpoint cast to fp16)
    widened to fp32 (``WidenOtherSixteenBitPass``); the model's conversions that a
    write in place reaches pinned as copies or
    aliases (``PreserveCopiesPass``), before any dtype changes; with the policy's
    ``stabilize`` (the default), the exact stable rewrites of patterns 16-bit spoils
    (``StabilizePass``; ``eps_clamp`` adds its one inexact rule);
    the analyses next, while the program still computes in fp32:
    calibration, unsafe indices, integer ranges (``input_ranges``; floats made from
    integers take their range from it), conditioning and underflow (which read
    both), the routers the policy keeps (which read the index marks), which of the
    model's own fp32 regions to keep, the safety rules that
    read them all (``Fp32RulesAnalysis``), and the check of the verdicts that cost
    FLOPs or may not help (``VerdictCheckAnalysis``, on the calibration inputs);
    then state tensors and user inputs, so the cast inserter sees every graph input
    in its final dtype; then the inserter walks the graph once, and a state tensor it
    reads only through casts up to fp32 is stored in fp32 (``StoreAsReadPass``); cleanup last,
    because it only removes casts and needs them all in place. Options: see
    ``fx16.cast_fp32_to_fp16``; ``force_fp32`` names nodes that must stay fp32.
    A policy that changes nothing (``always_fp32``) gives an empty list.
    """
    return fp16_stages(ep, Fp16Options.of("fp16_passes", options, **keywords)).passes()


def fp16_stages(ep, options: Fp16Options) -> Fp16Stages:
    """``fp16_passes`` by stage (``fx16.stages.Fp16Stages``): an accuracy search runs the
    stages before the decisions once, and the rest for each fp32 set it tries (the only
    ones ``force_fp32`` changes)."""
    program = Program.of(ep)
    options, policy = _checked(program, options)
    if policy.is_noop:
        return Fp16Stages()
    return Fp16Stages(**_preparing(program, options, policy), **_deciding(program, options, policy))


def _preparing(program: Program, options: Fp16Options, policy: PrecisionPolicy) -> dict:
    rewrites = policy.stabilize or policy.eps_clamp
    keep_model_fp32 = policy.explicit_fp32 == "keep"
    stabilize = (
        [StabilizePass(policy.low, policy.stabilize, policy.eps_clamp, None, keep_model_fp32)]
        if rewrites
        else []
    )
    limit, calls = overflow_limit(policy, options.overflow_margin), options.calibration
    scaling = []
    if policy.low == torch.float16 and policy.scale_range:
        keeps = policy.explicit_fp32 == "keep"  # every fp32 region of the model stays fp32
        scaling = [ScaleDomainsAnalysis(program, limit, keeps), ScaleDomainsPass(program, calls)]
    return {
        "prepare": [
            RecordStatsPass(program),
            WidenOtherSixteenBitPass(program, OTHER_SIXTEEN_BIT[policy.low]),
            PreserveCopiesPass(),
            *stabilize,
        ],
        "calibrate": [
            CalibrationAnalysis(program, calls),
            SentinelFillsPass(program, policy.low, calls),
            SentinelSumsPass(policy.low, options.overflow_margin),
            *scaling,
        ],
        "analyze": [
            UnsafeIndexAnalysis(),
            ValueRangeAnalysis(program, options.input_ranges),
            ConditioningAnalysis(program, policy),
            UnderflowAnalysis(program, policy, options.overflow_margin),
            RoutingAnalysis(program, policy),
            ExplicitFp32Analysis(program, policy, options.overflow_margin),
        ],
    }


def _deciding(program: Program, options: Fp16Options, policy: PrecisionPolicy) -> dict:
    margin, forced = options.overflow_margin, options.force_fp32 | options.fallback
    limit = overflow_limit(policy, margin)
    shared = dict(policy=policy, force_fp32=forced)
    return {
        "decide": [
            Fp32RulesAnalysis.standard(policy.low, limit, program=program, options=options),
            VerdictCheckAnalysis(program, policy, options.calibration, limit=limit),
        ],
        "convert": [
            ConvertParametersPass(program, **shared),
            ConvertUserInputsPass(program, overflow_margin=margin, **shared),
        ],
        "insert": [
            InsertFP16CastsPass(program, overflow_margin=margin, **shared),
            StoreAsReadPass(program),
            *([RangeFallbackPass(program)] if _falls_back_to_bf16(policy) else []),
            RecastAfterWritesPass(),
        ],
        "cleanup": [
            CleanupCastsPass(program),
            ScalarsAsConstantsPass(program, options.scalars, SIXTEEN_BIT_DTYPES),
        ],
    }


def _falls_back_to_bf16(policy: PrecisionPolicy) -> bool:
    """The policy computes in fp16 and asks for bf16 where fp16's range falls short."""
    return policy.low == torch.float16 and policy.range_fallback == "bf16"


def _checked(program: Program, options: Fp16Options) -> tuple[Fp16Options, PrecisionPolicy]:
    """``options`` with ``force_fp32`` as a set of names, and the policy they resolve to;
    ``InvalidOptionError`` for a bad margin or a name that matches nothing."""
    # a margin below 1 would count values beyond the 16-bit maximum as fitting
    require_number("overflow_margin", options.overflow_margin, 1)
    require_flag("stabilize", options.stabilize)
    require_flag("eps_clamp", options.eps_clamp)
    policy = resolve_policy(
        options.policy,
        target=options.target,
        explicit_fp32=options.explicit_fp32,
        keep_io_types=options.keep_io_types,
        stabilize=options.stabilize,
        eps_clamp=options.eps_clamp,
        routing=options.routing,
        range_fallback=options.range_fallback,
    )
    options = replace(options, force_fp32=as_names(options.force_fp32))
    check_names(program, policy, options.force_fp32)
    refuse_nothing_to_cast(program, policy.low)
    return options, policy


def refuse_nothing_to_cast(program: Program, low: torch.dtype) -> None:
    """``InvalidProgramError`` for a program that computes in ``low`` already and holds
    no fp32 value (an export of ``model.half()`` cast to fp16), which fx16 has not cast
    before (a second cast of its own result is a no-op): there is nothing to cast, and
    saying so beats a silent no-op. A program made in the other 16-bit dtype is widened
    and cast (``WidenOtherSixteenBitPass``), unless fx16 made it so: its decisions are
    about that dtype, so the fp32 program it was cast from is the one to cast again."""
    cast_before = cast_by_fx16(program.graph_module, PRECISION)
    other = OTHER_SIXTEEN_BIT[low]
    if not cast_before and _computes_only_in(program, low):
        raise InvalidProgramError(
            f"the program computes in {dtype_name(low)} already and holds no float32 value: "
            f"nothing to cast to {dtype_name(low)} (cast the fp32 program it was made from, "
            f"or choose a {dtype_name(other)} policy to convert it)"
        )
    if cast_before and made_in(program, other, Boundaries(program.graph_module)):
        raise InvalidProgramError(
            f"fx16 cast this program to {dtype_name(other)} already: cast the fp32 program "
            f"it was made from to {dtype_name(low)} instead"
        )


def _computes_only_in(program: Program, low: torch.dtype) -> bool:
    """The program holds a ``low`` value and no fp32 one (it stops at the first fp32
    value: in an fp32 program, its first weight)."""
    holds_low = False
    for module in nested_graph_modules(program.graph_module):
        for node in module.graph.nodes:
            for leaf in tensor_leaves(node_val(node)):
                if leaf.dtype == FP32:
                    return False
                holds_low = holds_low or leaf.dtype == low
    return holds_low


def without_rules(passes: list[PassBase], *rule_types: type) -> list[PassBase]:
    """``passes`` with the safety rules of the given types taken out of their
    ``Fp32RulesAnalysis`` stages: to measure what a rule buys, or to drop one."""
    return [
        Fp32RulesAnalysis(
            [rule for rule in stage.rules if not isinstance(rule, rule_types)], stage.program
        )
        if isinstance(stage, Fp32RulesAnalysis)
        else stage
        for stage in passes
    ]


def int16_passes(
    ep,
    *,
    input_ranges: dict | None = None,
    int16: str = "proven",
    calibration: list | None = None,
    **unknown,
) -> list[PassBase]:
    """The int32/int64 -> int16 pipeline for ``ep``, as fresh pass instances.

    Order: copies pinned first (as in ``fp16_passes``), then the four analyses
    (reachability and unsafe indices feed the castable set; ranges are independent of
    both; with ``int16="observed"``, calibration before the ranges); the inserter
    next, then the input converter, which narrows only inputs that int16 ops read;
    cleanup next; last, the Python ints of int16 ops that int16 holds as int16
    constants. ``int16="off"``
    gives an empty list. Options: see ``fx16.cast_int32_to_int16``.
    """
    reject_unknown(int16_passes, unknown)
    program = Program.of(ep)
    if check_mode(int16) == "off":
        if input_ranges:
            raise InvalidOptionError("input_ranges has no effect with int16='off'; drop one")
        return []
    observe = [CalibrationAnalysis(program, calibration)] if int16 == "observed" else []
    return [
        RecordStatsPass(program),
        PreserveCopiesPass(),
        UserReachabilityAnalysis(program),
        UnsafeIndexAnalysis(),
        CastableInt16Analysis(program),
        *observe,
        ValueRangeAnalysis(program, input_ranges),
        InsertInt16CastsPass(program, mode=int16),
        ConvertIntInputsPass(program, mode=int16),
        RecastAfterWritesPass(),
        CleanupCastsPass(program),
        ScalarsAsConstantsPass(program, dtypes=(torch.int16,)),
    ]


def keyword_options(function) -> set[str]:
    """The keyword-only options ``function`` accepts."""
    parameters = inspect.signature(function).parameters.items()
    return {name for name, p in parameters if p.kind == p.KEYWORD_ONLY}


def reject_unknown(function, unknown: dict) -> None:
    """``InvalidOptionError`` naming ``unknown`` options and the ones ``function`` takes."""
    if unknown:
        raise InvalidOptionError(
            f"{function.__name__}: unknown option(s) {sorted(unknown)}; "
            f"accepted: {sorted(keyword_options(function))}"
        )


def run_passes(passes: list[PassBase], graph_module: GraphModule, recompile: bool = True) -> bool:
    """Run ``passes`` in order on ``graph_module``, then mark its code stale once, to be
    generated when it is first needed (``compile_when_needed``: ``ep.module()``,
    ``torch.export.save`` and ``run_decompositions`` never need it).

    Same effect as ``PassManager(passes)(graph_module)``, which recompiles after
    every pass. A pass that raises anything but an ``Fx16Error`` raises a
    ``PassFailedError`` naming it, from the original exception.
    After each pass that changed the graph, the analyses it does not declare it
    preserves are forgotten
    (``fx16.contracts.forget_unpreserved``): a later pass that reads one fails
    ``requires`` rather than read what the rewrite made stale.
    ``recompile=False`` leaves that to the caller, who runs more passes first (none of
    fx16's runs the root's code: calibration interprets the graph).
    Returns whether any pass modified the graph.
    """
    modified = False
    for pass_ in passes:
        try:
            result = pass_(graph_module)
        except Fx16Error:
            raise
        except Exception as error:
            raise PassFailedError(type(pass_).__name__, error, restored=False) from error
        changed = result is None or result.modified  # a pass that changed nothing keeps all
        if changed and forget_unpreserved(graph_module, pass_):
            Facts.invalidate(graph_module)
        modified = modified or bool(result and result.modified)
    if recompile:
        compile_when_needed(graph_module)
    return modified
