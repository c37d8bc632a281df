"""Transforms: each module holds one pass that rewrites the graph or program state."""

from fx16.passes.bypass_branching_casts import BypassBranchingCastsPass
from fx16.passes.cleanup_casts import CleanupCastsPass
from fx16.passes.convert_int_inputs import ConvertIntInputsPass
from fx16.passes.convert_parameters import ConvertParametersPass
from fx16.passes.convert_user_inputs import ConvertUserInputsPass
from fx16.passes.deduplicate_casts import DeduplicateCastsPass
from fx16.passes.fuse_cast_chains import FuseCastChainsPass
from fx16.passes.insert_fp16_casts import InsertFP16CastsPass
from fx16.passes.insert_int16_casts import InsertInt16CastsPass
from fx16.passes.preserve_copies import PreserveCopiesPass
from fx16.passes.range_fallback import RangeFallbackPass
from fx16.passes.recast_after_writes import RecastAfterWritesPass
from fx16.passes.record_stats import RecordStatsPass
from fx16.passes.remove_identity_arithmetic import RemoveIdentityArithmeticPass
from fx16.passes.remove_noop_casts import RemoveNoopCastsPass
from fx16.passes.remove_unused_casts import RemoveUnusedCastsPass
from fx16.passes.scalars_as_constants import ScalarsAsConstantsPass
from fx16.passes.scale_domains import ScaleDomainsPass
from fx16.passes.sentinel_fills import SentinelFillsPass
from fx16.passes.sentinel_sums import SentinelSumsPass
from fx16.passes.stabilize import StabilizePass
from fx16.passes.store_as_read import StoreAsReadPass
from fx16.passes.widen_other_sixteen_bit import WidenOtherSixteenBitPass

__all__ = [
    "BypassBranchingCastsPass",
    "CleanupCastsPass",
    "ConvertIntInputsPass",
    "ConvertParametersPass",
    "ConvertUserInputsPass",
    "DeduplicateCastsPass",
    "FuseCastChainsPass",
    "InsertFP16CastsPass",
    "InsertInt16CastsPass",
    "PreserveCopiesPass",
    "RangeFallbackPass",
    "RecastAfterWritesPass",
    "RecordStatsPass",
    "RemoveIdentityArithmeticPass",
    "RemoveNoopCastsPass",
    "RemoveUnusedCastsPass",
    "ScalarsAsConstantsPass",
    "ScaleDomainsPass",
    "SentinelFillsPass",
    "SentinelSumsPass",
    "StabilizePass",
    "StoreAsReadPass",
    "WidenOtherSixteenBitPass",
]
