"""The mutation score of the safety-critical modules: mutmut's mutants, killed or not.

    pip install mutmut   # 3.x
    python -m benchmarks.mutation [--output benchmarks/MUTATION.md]

mutmut (configured under ``[tool.mutmut]`` in ``pyproject.toml``: which modules it
mutates, which tests it runs) copies the package into ``mutants/``, changes one
operator, constant or call at a time in the modules named there, and runs the tests
that reach the changed function. A mutant the tests fail on is killed; one they pass
on survives. A surviving mutant is either a missing test or an equivalent mutant (a
change no input can tell apart); the equivalent ones are listed in ``EQUIVALENT``
below, each with its reason, and left out of the score. The goal: at least 90% of the
other mutants killed on these modules. Run it when they change; CI does not (it takes
tens of minutes).
"""

import argparse
import json
import subprocess
import sys
from collections import Counter
from datetime import date
from pathlib import Path

from benchmarks.markdown import table_row, write_results

ROOT = Path(__file__).resolve().parent.parent
TITLE = "Mutation score of the safety-critical modules"

# mutant name (mutmut's "module.x_function__mutmut_N") -> why no test can kill it.
_SAME_VALUES_OTHER_BUFFER = "the same values through a temporary instead of the reused scratch"
_MIN_POSITIONAL = (
    "torch.export writes clamp's and clamp_min's min positionally: args[1] is always there"
)
_NO_EMPTY_RATIOS = (
    "no ratios while the values have elements: a group is what the reduced dims leave, "
    "and an input without elements returned 1.0 before"
)
_FINITE_RATIO = (
    "a ratio is counted only where the deviation exceeds 16 fp32 roundings of the "
    "largest magnitude, so it is below 1 / (16 eps), never infinite or NaN"
)
_OPNAME_DEFAULT = "the `_opname` default: every conditioned op is an OpOverload, which has one"
_CANDIDATE_AT_END = (
    "`<=` at the interval's end: the stationary point is then the end itself, already a candidate"
)
_MAGNITUDE = (
    "`(+largest, largest)`: only the interval's largest magnitude is judged, and largest >= 0"
)
_DEFAULT_DTYPE = "a fake tensor retyped to None takes torch's default dtype, float32: the same"
_FP32_MAXIMUM_OUT_OF_REACH = (
    "the large side of holds_in_fp32 only: a positive exponent is a lifted domain's, which "
    "brings its values to at most fp16's range; a product of two holds at most 2**32, and "
    "fp32's maximum (2**128) is out of reach"
)
_RECORDED_FIRST = (
    "the walk records every value before a reader asks for its exponent: the default is never read"
)
_NO_DICT_ARGUMENT = "the dict branch: no ATen op's argument holds a dict"
_NO_ZERO_EXPONENT = (
    "an overflow domain's least exponent that fits is at most -1 (its values pass the limit "
    "at 2**0): no domain's exponent is 0, where >= 0, > 0 and >= 1 differ"
)

EQUIVALENT: dict[str, str] = {
    "fx16.ops.numerics.x_round_scalar_to_fp16__mutmut_19": (
        "`<= tiny`: at exactly the smallest subnormal, lifting to it and rounding give it"
    ),
    "fx16.ops.numerics.x_tensor_to_fp16__mutmut_12": (
        "`< _CHUNK`: a tensor of exactly one chunk takes the chunked path, same values"
    ),
    "fx16.ops.numerics.x_tensor_to_fp16__mutmut_21": _SAME_VALUES_OTHER_BUFFER,
    "fx16.ops.numerics.x_tensor_to_fp16__mutmut_27": _SAME_VALUES_OTHER_BUFFER,
    "fx16.ops.numerics.x_tensor_to_fp16__mutmut_30": _SAME_VALUES_OTHER_BUFFER,
    "fx16.ops.numerics.x_tensor_to_fp16__mutmut_75": _SAME_VALUES_OTHER_BUFFER,
    "fx16.ops.numerics.x_tensor_to_fp16__mutmut_93": _SAME_VALUES_OTHER_BUFFER,
    "fx16.ops.numerics.x_tensor_to_fp16__mutmut_97": (
        "a scratch slice longer than the chunk: torch resizes the output, same values"
    ),
    "fx16.ops.numerics.x_tensor_to_fp16__mutmut_52": (
        "a 0-d tensor not viewed as 1-d: the boolean mask lifts a 0-d value the same way"
    ),
    "fx16.ops.numerics.x_conversion_scratch__mutmut_2": (
        "a float32 scratch: the magnitude bits land in it as exact integers, same zeros"
    ),
    "fx16.ops.numerics.x_conversion_scratch__mutmut_4": (
        "a float32 scratch: the magnitude bits land in it as exact integers, same zeros"
    ),
    "fx16.passes.bypass_branching_casts.xǁBypassBranchingCastsPassǁmatch__mutmut_3": (
        "`>= 1`: a chain with one consumer gets the rewrite FuseCastChainsPass gives it"
    ),
    "fx16.program.aliases.x__shares_storage_with__mutmut_7": (
        "a user that calls no function is the output node, which writes nothing"
    ),
    "fx16.program.aliases.x__shares_storage_with__mutmut_10": (
        "`<= len(args)`: the aliased argument of every view and in-place op is positional"
    ),
    "fx16.ops.numerics.x__convert_chunk__mutmut_5": _SAME_VALUES_OTHER_BUFFER,
    "fx16.ops.numerics.x__convert_chunk__mutmut_8": _SAME_VALUES_OTHER_BUFFER,
    "fx16.analysis.intervals.x__show__mutmut_10": (
        "`bound <= 0` for a bound that is not finite: it is +-inf, never 0"
    ),
    "fx16.analysis.intervals.x__show__mutmut_11": (
        "`bound < 1` for a bound that is not finite: it is +-inf, never in [0, 1)"
    ),
    "fx16.analysis.intervals.x_add_ranges__mutmut_1": (
        "a default sign of 2 instead of 1: only the sign's side of zero is read"
    ),
    "fx16.analysis.intervals.x_add_ranges__mutmut_8": ("`sign >= 0`: every caller passes +1 or -1"),
    "fx16.passes.cast_rule.xǁCastRuleǁcall__mutmut_1": (
        "`modified = None` when nothing matched: every caller reads it as false"
    ),
    "fx16.passes.cast_rule.xǁCastRuleǁcall__mutmut_16": (
        "output specs synced when nothing changed: they already match the graph"
    ),
    "fx16.passes.cast_rule.xǁCastRuleǁcall__mutmut_19": (
        "PassResult without its graph module: every caller reads only `modified`"
    ),
    "fx16.ops.numerics.x__lift_flushed_blocks__mutmut_2": (
        "no early return when nothing flushed: the search that follows finds nothing"
    ),
    "fx16.analysis.fp32_rules.xǁFp32RulesAnalysisǁneeding_nothing__mutmut_3": (
        "no overflow limit: ObservedOverflowRule needs calibration, so needing_nothing drops it"
    ),
    "fx16.analysis.fp32_rules.xǁFp32RulesAnalysisǁneeding_nothing__mutmut_12": (
        "`getattr(rule, 'needs', None)`: a rule without needs is kept either way"
    ),
    "fx16.analysis.fp32_rules.xǁObservedOverflowRuleǁwritten_over__mutmut_4": (
        "every node asked: a placeholder's, output's or get_attr's target (a name) writes nothing"
    ),
    "fx16.analysis.underflow.xǁUnderflowAnalysisǁcall__mutmut_22": (
        "a scalar argument among `reads`: elementwise_past skips what has no tensor value"
    ),
    "fx16.analysis.underflow.xǁUnderflowAnalysisǁcall__mutmut_31": (
        "elementwise_past(None, ...): the seed is only marked seen, and it is downstream of "
        "every value it reads"
    ),
    "fx16.analysis.underflow.xǁUnderflowAnalysisǁcall__mutmut_43": (
        "PassResult without its graph module: every caller reads only `modified`"
    ),
    "fx16.analysis.underflow.xǁUnderflowAnalysisǁcall__mutmut_44": (
        "`modified=None`: every caller reads it as false"
    ),
    "fx16.analysis.underflow.xǁUnderflowAnalysisǁverdict__mutmut_8": (
        "integer results judged too: an integer's smallest nonzero magnitude is 1, above "
        "every 16-bit smallest normal, so no verdict follows"
    ),
    "fx16.analysis.underflow.xǁUnderflowAnalysisǁverdict__mutmut_44": (
        "`smallest <= 1` for an exponential tail: at 1 its widened value is 1, above the "
        "smallest normal, and the general path finds 1 above it too: no verdict either way"
    ),
    "fx16.analysis.underflow.xǁUnderflowAnalysisǁverdict__mutmut_45": (
        "`smallest < 2`: from 1 on, both an exponential's widened value and the general "
        "path stay above the smallest normal: no verdict either way"
    ),
    "fx16.analysis.underflow.x__guard__mutmut_17": _MIN_POSITIONAL,
    "fx16.analysis.underflow.x__guard__mutmut_19": _MIN_POSITIONAL,
    "fx16.analysis.underflow.x__guard__mutmut_21": _MIN_POSITIONAL,
    "fx16.analysis.underflow.x__guard__mutmut_22": _MIN_POSITIONAL,
    "fx16.analysis.underflow.x__guard__mutmut_23": _MIN_POSITIONAL,
    "fx16.analysis.underflow.x_small_end__mutmut_10": (
        "an end without its source: only an exponential's, softmax's and statistic's is read"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_83": (
        "an end without its source: only an exponential's, softmax's and statistic's is read"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_87": (
        "an end without its source: only an exponential's, softmax's and statistic's is read"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_48": (
        "a softmax end without its guard: only a statistic's guard is read"
    ),
    "fx16.analysis.underflow.x__squares__mutmut_2": (
        "`isinstance(node, Node) or ...`: every caller passes a node, and a placeholder's or "
        "get_attr's target (a name) is neither a power nor a multiply"
    ),
    "fx16.analysis.underflow.x__smallest_magnitude__mutmut_8": (
        "the label of a missing magnitude: the verdict returns before reading it"
    ),
    "fx16.analysis.underflow.x_singular_argument__mutmut_3": (
        "every node asked: a placeholder's or output's target (a name) is in no op table"
    ),
    "fx16.analysis.underflow.x_singular_argument__mutmut_10": (
        "`position > len(args)`: torch.export writes a singular op's operands positionally"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_11": (
        "a bounded or `other` end without its guard: only a statistic's guard is read"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_14": (
        "a bounded or `other` end without its guard: only a statistic's guard is read"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_84": (
        "a bounded or `other` end without its guard: only a statistic's guard is read"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_88": (
        "an `other` end whose source may be a number: no verdict or chain reads it"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_13": (
        "a bounded end without its source: the verdict returns on the kind alone"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_45": (
        "a softmax end without its guard: only a statistic's guard is read"
    ),
    "fx16.analysis.underflow.x_small_end__mutmut_80": (
        "an `other` end without its source: no verdict or chain reads it"
    ),
    "fx16.analysis.underflow.xǁUnderflowAnalysisǁwidened__mutmut_12": (
        "`or 2.0`: the largest magnitude is falsy only where calibration saw no nonzero "
        "value, and then there is no smallest one to widen (the verdict returned before)"
    ),
    # run 6: the cancellation analyses
    "fx16.analysis.centering.x__batch_norm__mutmut_17": (
        "`args[4] is None` for `args[3]`: torch takes a batch norm's running mean and "
        "variance together or not at all"
    ),
    "fx16.analysis.centering.x_cancellation_ratio__mutmut_33": _NO_EMPTY_RATIOS,
    "fx16.analysis.centering.x_cancellation_ratio__mutmut_35": _NO_EMPTY_RATIOS,
    "fx16.analysis.centering.x_cancellation_ratio__mutmut_37": _FINITE_RATIO,
    "fx16.analysis.centering.x_cancellation_ratio__mutmut_39": _FINITE_RATIO,
    "fx16.analysis.conditioning.x__exponential__mutmut_8": _CANDIDATE_AT_END,
    "fx16.analysis.conditioning.x__exponential__mutmut_12": _CANDIDATE_AT_END,
    "fx16.analysis.conditioning.x__condition__mutmut_88": (
        "`args[:3]`: torch.export writes a sum's alpha as a keyword, so its args are (a, b)"
    ),
    "fx16.analysis.conditioning.x__condition__mutmut_6": _OPNAME_DEFAULT,
    "fx16.analysis.conditioning.x__condition__mutmut_9": _OPNAME_DEFAULT,
    "fx16.analysis.conditioning.x__condition__mutmut_12": _OPNAME_DEFAULT,
    "fx16.analysis.conditioning.x__condition__mutmut_54": (
        "`or` for `and`: of the conditioned ops only pow(b, x) takes a number first, and a "
        "sum that reaches this line reads two nodes"
    ),
    "fx16.analysis.conditioning.x__cancellation__mutmut_25": (
        "a missing slice ratio read as 1.0, not 0.0: below 8, and below a whole ratio that passed 8"
    ),
    # run 7: the precedence lists and the fp32 rules, whole
    "fx16.plan.precedence.x_choose__mutmut_5": (
        "the message of an error no program reaches: every list ends in a rule that always "
        "applies (test_each_list_is_ordered_data_that_ends_in_a_rule_that_always_applies)"
    ),
    "fx16.plan.precedence.x__policy_follow__mutmut_3": (
        "follow for promote: with inputs of two widths the kernel either promotes (an fp32 "
        "result, whose 16-bit inputs the rewrite widens as promote does) or refuses (follow "
        "then retries as promote); cat, mul, batch norm and a layer norm with an fp32 weight "
        "gave the same graph either way (observed, not proven for every op)"
    ),
    # run 8: the range code (the range rules, the bf16 fallback, widening, store-as-read)
    "fx16.analysis.safety_rules.range.xǁObservedOverflowRuleǁwritten_over__mutmut_4": (
        "every node asked: a placeholder's, output's or get_attr's target (a name) writes nothing"
    ),
    "fx16.analysis.safety_rules.range.xǁObservedBelowRangeRuleǁapplies__mutmut_22": _MAGNITUDE,
    "fx16.analysis.safety_rules.range.xǁObservedBelowRangeRuleǁ_absorbed_by__mutmut_16": (
        _MAGNITUDE
    ),
    "fx16.passes.store_as_read.xǁStoreAsReadPassǁcall__mutmut_7": (
        "`pending[...][1] != FP32` (the may-flush flag, never a dtype): a slot pending fp32 "
        "is read as fp32 already, so no cast up reads it and it is left as it was"
    ),
    "fx16.passes.store_as_read.xǁStoreAsReadPassǁcall__mutmut_28": _DEFAULT_DTYPE,
    "fx16.passes.store_as_read.x__read_only_through_fp32_casts__mutmut_7": (
        "`is_inserted(user) or ...`: only casts carry `fx16.inserted`"
    ),
    "fx16.passes.widen_other_sixteen_bit.xǁWidenOtherSixteenBitPassǁ_widened__mutmut_4": (
        _DEFAULT_DTYPE
    ),
    # run 11: the scale domains, whole
    "fx16.analysis.scale_centre.x_centre__mutmut_4": _NO_ZERO_EXPONENT,
    "fx16.analysis.scale_exponents.xǁ_Walkǁresult__mutmut_7": (
        "a getitem has exactly two arguments: [:3] and [:2] are the same pair"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁresult__mutmut_10": (
        "the walk records every node before its readers: a getitem's source always has an "
        "entry, so the default is never read"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁseen__mutmut_5": _RECORDED_FIRST,
    "fx16.analysis.scale_moves.xǁPlanMovesǁseen__mutmut_7": _RECORDED_FIRST,
    "fx16.analysis.scale_moves.xǁPlanMovesǁseen__mutmut_8": _RECORDED_FIRST,
    "fx16.analysis.scale_moves.xǁPlanMovesǁseen__mutmut_9": (
        "a multi-output op is read only through getitem (export's form), which reads its "
        "leaf's exponent: seen() never meets the tuple"
    ),
    "fx16.analysis.scale_plan.x_node_leaves__mutmut_6": _NO_DICT_ARGUMENT,
    "fx16.analysis.scale_plan.x_node_leaves__mutmut_8": _NO_DICT_ARGUMENT,
    "fx16.analysis.scale_domains.x__fold_upstream__mutmut_2": (
        "None or False: the caller reads only its truth"
    ),
    "fx16.analysis.scale_plan.x_holds_in_fp32__mutmut_3": _FP32_MAXIMUM_OUT_OF_REACH,
    "fx16.analysis.scale_plan.x_holds_in_fp32__mutmut_11": _FP32_MAXIMUM_OUT_OF_REACH,
    "fx16.analysis.scale_plan.x_holds_in_fp32__mutmut_13": _FP32_MAXIMUM_OUT_OF_REACH,
    "fx16.analysis.scale_centre.x_centre__mutmut_5": _NO_ZERO_EXPONENT,
    "fx16.analysis.scale_centre.x_centre__mutmut_14": (
        "a default for a member without a magnitude: the domain holds a member past the "
        "limit (above 1), so neither 0 nor 1 is ever the largest"
    ),
    "fx16.analysis.scale_centre.x__costlier__mutmut_30": (
        "`0 <=`: a scalar of 0 stays 0 at any exponent, so the least-k plan's is 0 too, never "
        "normal"
    ),
    "fx16.analysis.scale_centre.x__costlier__mutmut_36": (
        "a trial plan scales the scalars the least-k plan scaled (the same walk over the same "
        "members, at another nonzero exponent): the default is never read"
    ),
    "fx16.analysis.scale_centre.x__costlier__mutmut_38": (
        "a trial plan scales the scalars the least-k plan scaled (the same walk over the same "
        "members, at another nonzero exponent): the default is never read"
    ),
    "fx16.analysis.scale_centre.x__costlier__mutmut_39": (
        "a trial plan scales the scalars the least-k plan scaled (the same walk over the same "
        "members, at another nonzero exponent): the default is never read"
    ),
    "fx16.analysis.scale_centre.x__fold_fits__mutmut_12": (
        "no plan folds a tensor past the limit: a refold asks `movable` first, and a domain's "
        "own members fold at its exponent, which centring only raises (their folds shrink), "
        "so `scaled > limit` is never true here"
    ),
    "fx16.analysis.scale_centre.x__fold_fits__mutmut_14": (
        "at exponent 0 the fold is the tensor as it is, and `scaled >= min(magnitude, floor)` "
        "holds for it: the same answer"
    ),
    "fx16.analysis.scale_centre.x__fold_fits__mutmut_15": (
        "at exponent 0 the fold is the tensor as it is, and `scaled >= min(magnitude, floor)` "
        "holds for it: the same answer"
    ),
    "fx16.analysis.scale_centre.x__fold_fits__mutmut_3": (
        "every state tensor has a calibrated magnitude (calibration observes every "
        "placeholder): the default is never read"
    ),
    "fx16.analysis.scale_centre.x__fold_fits__mutmut_5": (
        "every state tensor has a calibrated magnitude (calibration observes every "
        "placeholder): the default is never read"
    ),
    "fx16.analysis.scale_centre.x__fold_fits__mutmut_6": (
        "every state tensor has a calibrated magnitude (calibration observes every "
        "placeholder): the default is never read"
    ),
    "fx16.analysis.scale_centre.x__small_end_room__mutmut_13": (
        "a member with a state key is a foldable tensor, and a centred domain folds each of "
        "its foldable members: `key not in plan.folds` never holds for one"
    ),
    "fx16.analysis.scale_centre.x__small_end_room__mutmut_6": (
        "every member of a domain has a calibrated magnitude: the default is never read"
    ),
    "fx16.analysis.scale_centre.x__small_end_room__mutmut_8": (
        "every member of a domain has a calibrated magnitude: the default is never read"
    ),
    "fx16.analysis.scale_centre.x__small_end_room__mutmut_9": (
        "every member of a domain has a calibrated magnitude: the default is never read"
    ),
    "fx16.analysis.scale_domains.x__body_state__mutmut_2": (
        "a placeholder without users is never the one reader the check below asks for (the "
        "readers are the sinks that have users)"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_lift__mutmut_10": (
        "every member of a domain has a calibrated magnitude (`_magnitudes` holds each "
        "single-tensor value the domain grew through)"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_lift__mutmut_11": (
        "`<=` at the smallest normal: a lifted domain was seeded by a tensor strictly below "
        "it, which is smaller than one exactly at it, so the smallest (what the lift is "
        "computed from) is the same"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_lift__mutmut_24": (
        "`1 < needed`: a tensor below 2**-14 needs at least 2**7 to reach 2**-8, so needed is "
        "never 1"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_lift__mutmut_25": (
        "`0 <= needed`: a tensor below 2**-14 needs at least 2**7 to reach 2**-8, so needed "
        "is never 0"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_lift__mutmut_7": (
        "every member of a domain has a calibrated magnitude (`_magnitudes` holds each "
        "single-tensor value the domain grew through)"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_lift__mutmut_9": (
        "every member of a domain has a calibrated magnitude (`_magnitudes` holds each "
        "single-tensor value the domain grew through)"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁattention__mutmut_10": (
        "an exported graph passes attention's mask by position: the keyword is never read"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁattention__mutmut_11": (
        "an exported graph passes attention's mask by position: the keyword is never read"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁattention__mutmut_12": (
        "`or`: a missing mask is no node and no float tensor either way; a bool mask settles "
        "at 0, where it is"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁattention__mutmut_9": (
        "an exported graph passes attention's mask by position: the keyword is never read"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁfloor__mutmut_7": (
        "a floor taken for a shift is read only by floors and powers of two, which read its "
        "shift, never its exponent"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁlog2__mutmut_8": (
        "a log2 taken for a shift is read only by floors and powers of two, which read its "
        "shift, never its exponent"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁnorm__mutmut_15": (
        "`seen(None)` is 0: a norm without a weight has result exponent 0 either way"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁnorm__mutmut_28": (
        "the saved statistics of a norm in running-statistics form (outputs 1 and 2) have no "
        "reader in an inference graph"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁnorm__mutmut_49": (
        "reached only where a norm's eps is not a number (export always writes one); the "
        "scale then lands on the saved mean, which an inference graph never reads"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁnorm__mutmut_53": (
        "a norm's saved rstd (output 2) has no reader in an inference graph"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁproduct__mutmut_6": (
        "a product never reads a log2's shift: a log2 is a shift only where its every reader "
        "is a floor or a power"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁproduct__mutmut_72": (
        "the bias is refolded only where its delta is nonzero (`!= result` above): `<=` and "
        "`<` agree there"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁproduct__mutmut_73": (
        "the bias is refolded only where its delta is nonzero (`!= result` above): `< 1` and "
        "`< 0` agree there"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁproduct__mutmut_78": (
        "a product with a bias reads tensors: its scaled operand is always a node"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁproduct__mutmut_9": (
        "a product never reads a log2's shift: a log2 is a shift only where its every reader "
        "is a floor or a power"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁrecurrent__mutmut_12": (
        "the default of `lift` is read only where an RNN has no input weights in its list, "
        "which export never writes"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁrecurrent__mutmut_14": (
        "the default of `lift` is read only where an RNN has no input weights in its list, "
        "which export never writes"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁrecurrent__mutmut_16": (
        "the default of `lift` is read only where an RNN has no input weights in its list, "
        "which export never writes"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁrecurrent__mutmut_22": (
        "the reader names only a break, and an RNN's input weight read there alone always "
        "refolds back to 0 (it fitted there before its lift)"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁsame__mutmut_16": (
        "a SAME op without a float operand reads an integer tensor there, and "
        "`reads_unscaled_numbers` sends it to `opaque` first"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁsame__mutmut_18": (
        "a SAME op without a float operand reads an integer tensor there, and "
        "`reads_unscaled_numbers` sends it to `opaque` first"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁscale_free__mutmut_13": (
        "a scale-free op without a float operand reads an integer or bool tensor there, and "
        "`reads_unscaled_numbers` sends it to `opaque` first"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁscale_free__mutmut_16": (
        "a scale-free op without a float operand reads an integer or bool tensor there, and "
        "`reads_unscaled_numbers` sends it to `opaque` first"
    ),
    "fx16.analysis.scale_members.x__logarithm_argument__mutmut_1": (
        "the walk starts at a power's exponent and follows floors' first arguments: always "
        "nodes; a placeholder leaves the loop with [] either way"
    ),
    "fx16.analysis.scale_members.x__logarithm_argument__mutmut_9": (
        "log2.default reads a tensor: its argument is always a node"
    ),
    "fx16.analysis.scale_members.x__small__mutmut_20": (
        "a domain seeded by an RNN weight other than its first layer's input weights is "
        "dropped: the recurrent rule reads those at 0, so the lift is taken back "
        "(`test_tiny_recurrent_weights_other_than_the_input_ones_start_no_domain` passes "
        "under it)"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁ_fold_number__mutmut_7": (
        "export writes a product's number second (`h * 2.0`, `h / 8.0`): the first position "
        "never holds one"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁ_fold_number__mutmut_8": (
        "export writes a product's number second (`h * 2.0`, `h / 8.0`): the first position "
        "never holds one"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁfree_refold__mutmut_4": (
        "called from the product rule only: the kind is always PRODUCT"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁlower_door__mutmut_17": (
        "`or 1.0`: a user input always has calibration's observed magnitude (scale domains "
        "are planned from calibration, which observes every placeholder)"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁlower_door__mutmut_9": (
        "`delta >= 0`: the caller asks only for a nonzero delta (`if delta and ...`)"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁrefold__mutmut_4": (
        "every caller asks for a nonzero delta (`settle` and the product rule test it first; "
        "a lift, an undo and a door move by a whole power)"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁrefold__mutmut_41": (
        "a placeholder is visited (its exponent set) before any reader refolds it: the "
        "default is never read"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁrefold__mutmut_43": (
        "a placeholder is visited (its exponent set) before any reader refolds it: the "
        "default is never read"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁrefold__mutmut_44": (
        "a placeholder is visited (its exponent set) before any reader refolds it: the "
        "default is never read"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁrefold__mutmut_71": (
        "a product is visited (its exponent set) before its reader refolds it: the default is "
        "never read"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁrefold__mutmut_73": (
        "a product is visited (its exponent set) before its reader refolds it: the default is "
        "never read"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁrefold__mutmut_74": (
        "a product is visited (its exponent set) before its reader refolds it: the default is "
        "never read"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁscale_eps__mutmut_17": (
        "a norm's eps is planned once per walk: there is never an earlier planned value to "
        "read back"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁscale_eps__mutmut_6": (
        "a location whose kind is not 'args' is read as a keyword: any other word does the same"
    ),
    "fx16.analysis.scale_moves.xǁPlanMovesǁscale_eps__mutmut_7": (
        "a location whose kind is not 'args' is read as a keyword: any other word does the same"
    ),
    "fx16.analysis.scale_plan.x_first_layer_input_weights__mutmut_15": (
        "export writes an RNN's parameters as a list and its layer count as an int: the guard "
        "for other forms is never reached"
    ),
    "fx16.analysis.scale_plan.x_first_layer_input_weights__mutmut_16": (
        "export writes an RNN's parameters as a list and its layer count as an int: the guard "
        "for other forms is never reached"
    ),
    "fx16.analysis.scale_plan.x_first_layer_input_weights__mutmut_27": (
        "a parameter list of layers x directions x (2 or 4) tensors divides by layers / "
        "directions too (remainder 0): only malformed lists differ"
    ),
    "fx16.analysis.scale_plan.x_first_layer_input_weights__mutmut_35": (
        "export passes an RNN's parameters as placeholders: every entry is a node"
    ),
    "fx16.analysis.scale_plan.x_floors_by_one__mutmut_13": (
        "`args[1:3]`: a floor division has two positional arguments, so the slice holds the "
        "divisor alone either way"
    ),
    "fx16.analysis.scale_plan.x_largest_operand__mutmut_9": (
        "every float operand of a visited op has a calibrated magnitude: the default is never read"
    ),
    "fx16.analysis.scale_plan.x_only_feeds_powers__mutmut_3": (
        "the output node's rule (the default, of no listed kind) is neither a floor nor a "
        "power, as None is not"
    ),
    "fx16.analysis.scale_plan.xǁStateTensorsǁmovable__mutmut_15": (
        "every state tensor has a calibrated magnitude (calibration observes every "
        "placeholder): the default is never read"
    ),
    "fx16.analysis.scale_plan.xǁStateTensorsǁmovable__mutmut_17": (
        "every state tensor has a calibrated magnitude (calibration observes every "
        "placeholder): the default is never read"
    ),
    "fx16.analysis.scale_plan.xǁStateTensorsǁmovable__mutmut_18": (
        "every state tensor has a calibrated magnitude (calibration observes every "
        "placeholder): the default is never read"
    ),
    "fx16.analysis.scale_plan.xǁStateTensorsǁmovable__mutmut_2": (
        "both callers (`refold`, the upstream walk) pass `added`: the default is never read"
    ),
    "fx16.analysis.scale_upstream.x_upstream_fold__mutmut_26": (
        "sorted without a key: torch.fx nodes order by their place in the graph, and the "
        "caller reads the list as a set"
    ),
    "fx16.analysis.scale_upstream.x_upstream_fold__mutmut_28": (
        "sorted without a key: torch.fx nodes order by their place in the graph, and the "
        "caller reads the list as a set"
    ),
    "fx16.analysis.scale_upstream.xǁ_Walkǁsources__mutmut_2": (
        "`float_operands` hands the walk nodes only: `not isinstance(node, Node)` is never true"
    ),
    "fx16.analysis.scale_upstream.xǁ_Walkǁsources__mutmut_37": (
        "a SAME op on the walk has a float operand: one without reads an integer tensor there "
        "and `reads_unscaled_numbers` returned None before"
    ),
    "fx16.ops.scaling.x__power__mutmut_2": (
        "a POWER rule's tensors are read by no stage: the power handler reads its base as "
        "`args[0]`, and the members, upstream walk and joins test the kind first"
    ),
    "fx16.ops.scaling.x__power__mutmut_5": (
        "a POWER rule's tensors are read by no stage: the power handler reads its base as "
        "`args[0]`, and the members, upstream walk and joins test the kind first"
    ),
    "fx16.ops.scaling.x__power__mutmut_7": (
        "a POWER rule's tensors are read by no stage: the power handler reads its base as "
        "`args[0]`, and the members, upstream walk and joins test the kind first"
    ),
    "fx16.passes.scale_domains.x__bound__mutmut_9": (
        "`>=`: where the bound equals what was seen, writing it changes nothing"
    ),
    "fx16.analysis.scale_domains.x__buys_nothing__mutmut_10": (
        "no member's exponent is a tuple: only a multi-output norm's is, and such a node has "
        "no magnitude to seed a domain and no rule that pulls or joins it (its getitem is the "
        "member)"
    ),
    "fx16.analysis.scale_domains.x__buys_nothing__mutmut_3": (
        "every member has an exponent: the walk records one for every placeholder and call, "
        "and members are those"
    ),
    "fx16.analysis.scale_domains.x__buys_nothing__mutmut_5": (
        "every member has an exponent: the walk records one for every placeholder and call, "
        "and members are those"
    ),
    "fx16.analysis.scale_domains.x__buys_nothing__mutmut_6": (
        "every member has an exponent: the walk records one for every placeholder and call, "
        "and members are those"
    ),
    "fx16.analysis.scale_domains.x__writes_floats_in_place__mutmut_3": (
        "`mutated_argument` of a placeholder or the output is None"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_plan__mutmut_118": (
        "torch.fx nodes sort by their place in the graph: sorted without a key gives the same order"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_plan__mutmut_120": (
        "torch.fx nodes sort by their place in the graph: sorted without a key gives the same order"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_plan__mutmut_4": (
        "grow_domains never read its graph module (the parameter is gone since)"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_plan__mutmut_61": (
        "the plan's first value is read only after the loop gives it one"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_plan__mutmut_73": (
        "no domain's exponent is 0 (an overflow's is at most -1, a small end's at least 6)"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁ_plan__mutmut_74": (
        "a positive exponent is at least 6: a small end's largest below 2**-14 is brought to "
        "[1, 2) (15 or more), a lift to at least 2**-8 (7 or more)"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁcall__mutmut_51": (
        "run_passes reads no module an analysis hands back"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁcall__mutmut_52": (
        "an analysis's modified=None reads as unchanged, as False does"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁcall__mutmut_55": (
        "an analysis preserves every fact (`preserves = ALL`): a modified flag forgets "
        "nothing, and no caller reads run_passes' answer for it"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁresult__mutmut_12": (
        "a getitem's source always has an exponent: it is visited first"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁresult__mutmut_13": (
        "a getitem's source always has an exponent: it is visited first"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁresult__mutmut_15": (
        "a norm's exponent tuple has one entry per output (`(result, scale, "
        "rstd)[:len(val)]`): a getitem's index is always inside it"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁresult__mutmut_16": (
        "a norm's exponent tuple has one entry per output (`(result, scale, "
        "rstd)[:len(val)]`): a getitem's index is always inside it"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁresult__mutmut_17": (
        "a norm's exponent tuple has one entry per output (`(result, scale, "
        "rstd)[:len(val)]`): a getitem's index is always inside it"
    ),
    "fx16.analysis.scale_exponents.xǁ_Walkǁvisit__mutmut_8": (
        "`folds.get(None, 0)` is 0: folds are keyed by state tensors, never None"
    ),
    "fx16.analysis.scale_members.x__is_float__mutmut_1": ("called with nodes only"),
    "fx16.analysis.scale_members.x__joins__mutmut_1": (
        "a reader that is not a call has the opaque rule (it joins nothing); a call without a "
        "float result is no SAME op reading a float (views, adds and pools of a float are "
        "float; a cast to another dtype is opaque)"
    ),
    "fx16.analysis.scale_members.x__pulled__mutmut_1": (
        "a node that is not a call has the opaque rule (nothing pulled); a call without a "
        "float result is never a member"
    ),
    "fx16.analysis.scale_members.x__pulled__mutmut_22": (
        "`argument(node, None)` is None: no operand"
    ),
    "fx16.analysis.scale_members.x__pulled__mutmut_48": (
        "only the NORM rules name a weight (a PRODUCT returned above)"
    ),
    "fx16.analysis.scale_members.x_grow_domains__mutmut_11": (
        "a group whose largest magnitude is exactly the limit gets no exponent (`largest > limit`)"
    ),
    "fx16.analysis.scale_members.x_grow_domains__mutmut_12": (
        "a value at INF_LIKE is a sentinel the loop skips: its group stays empty"
    ),
    "fx16.analysis.scale_members.x_grow_domains__mutmut_16": (
        "a group whose largest magnitude is exactly 2**-14 gets no exponent (neither below "
        "the normal range nor a lift, which counts magnitudes strictly below it)"
    ),
    "fx16.analysis.scale_members.x_grow_domains__mutmut_3": (
        "a seed in the model's fp32 regions (or one an earlier cast scaled) is dropped in the "
        "loop, which skips such nodes: its group stays empty"
    ),
    "fx16.analysis.scale_members.x_grow_domains__mutmut_32": (
        "`get(node, 1.0)` is below INF_LIKE as 0.0 is: the same test"
    ),
    "fx16.analysis.scale_members.x_grow_domains__mutmut_42": (
        "a merged-away group is dropped whether `[]` or None, and no node maps to it again"
    ),
    "fx16.ops.scaling.x_rule_of__mutmut_12": (
        "a cast node always holds a tensor value, which has a dtype"
    ),
    "fx16.passes.scale_domains.xǁScaleDomainsPassǁcall__mutmut_11": (
        "a pass's modified=None reads as unchanged, as False does"
    ),
    "fx16.passes.scale_domains.xǁScaleDomainsPassǁcall__mutmut_37": (
        "run_passes reads no module a pass hands back (the pass rewrote the one it was given)"
    ),
    "fx16.passes.scale_domains.xǁScaleDomainsPassǁcall__mutmut_51": (
        "a pass's modified=None reads as unchanged, as False does"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁcall__mutmut_10": (
        "run_passes reads no module an analysis hands back"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁcall__mutmut_11": (
        "an analysis's modified=None reads as unchanged, as False does"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁcall__mutmut_14": (
        "an analysis preserves every fact (`preserves = ALL`): a modified flag forgets "
        "nothing, and no caller reads run_passes' answer for it"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁcall__mutmut_18": (
        "run_passes reads no module an analysis hands back"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁcall__mutmut_19": (
        "an analysis's modified=None reads as unchanged, as False does"
    ),
    "fx16.analysis.scale_domains.xǁScaleDomainsAnalysisǁcall__mutmut_22": (
        "an analysis preserves every fact (`preserves = ALL`): a modified flag forgets "
        "nothing, and no caller reads run_passes' answer for it"
    ),
}


def run_mutmut() -> None:
    subprocess.run([sys.executable, "-m", "mutmut", "run"], cwd=ROOT, check=False)


def outcomes() -> dict[str, dict[str, str]]:
    """module path -> mutant name -> mutmut's status, from the meta files it leaves."""
    from mutmut.stats import status_by_exit_code  # killed, survived, timeout, not checked...

    found = {}
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        module = str(meta.relative_to(ROOT / "mutants")).removesuffix(".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        found[module] = {name: status_by_exit_code[code] for name, code in codes.items()}
    return found


HEADER = ["module", "mutants", "killed", "timeout", "survived", "no tests", "equivalent", "score"]


def _row(name: str, counts: Counter) -> list[str]:
    """A timeout counts as killed (the mutant never finished: the tests noticed)."""
    detected = counts["killed"] + counts["timeout"]
    scored = detected + counts["survived"] + counts["no tests"]
    score = f"{detected / scored:.0%}" if scored else "-"
    columns = ("killed", "timeout", "survived", "no tests", "equivalent")
    return [name, str(sum(counts.values())), *(str(counts[c]) for c in columns), score]


def report_lines(found: dict[str, dict[str, str]]) -> list[str]:
    """The table (a row per module and the total), the survivors and the equivalents."""
    lines = [table_row(HEADER), table_row(["---"] * len(HEADER))]
    totals, survivors = Counter(), []
    for module, mutants in found.items():
        counts = Counter(
            "equivalent" if name in EQUIVALENT and status == "survived" else status
            for name, status in mutants.items()
        )
        lines.append(table_row(_row(f"`{module}`", counts)))
        totals.update(counts)
        survivors += [
            f"- `{name}` ({status})"
            for name, status in mutants.items()
            if status in ("survived", "no tests") and name not in EQUIVALENT
        ]
    lines.append(table_row(_row("all", totals)))
    equivalent = [f"- `{name}`: {why}" for name, why in EQUIVALENT.items()]
    return [
        *lines,
        "",
        "## Surviving mutants, not equivalent",
        "",
        *(survivors or ["None."]),
        "",
        "## Equivalent mutants",
        "",
        *(equivalent or ["None listed."]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "MUTATION.md")
    parser.add_argument("--no-run", action="store_true", help="report the last run only")
    args = parser.parse_args()
    if not args.no_run:
        run_mutmut()
    notes = (
        f"{date.today().isoformat()}; the modules and tests are those under `[tool.mutmut]` in "
        "pyproject.toml. Score: (killed + timeout) / (killed + timeout + survived + no tests); "
        "equivalent mutants are left out. `mutmut run NAME...` re-checks only those mutants "
        "and leaves the rest not checked: run it whole for this table."
    )
    lines = report_lines(outcomes())
    write_results(args.output, TITLE, "python -m benchmarks.mutation", notes, lines)


if __name__ == "__main__":
    main()
