"""Analyses: passes that change no node and publish findings in ``node.meta["fx16.*"]``."""

from fx16.analysis.calibration import CalibrationAnalysis
from fx16.analysis.castable_int16 import CastableInt16Analysis
from fx16.analysis.conditioning import ConditioningAnalysis
from fx16.analysis.explicit_fp32 import ExplicitFp32Analysis
from fx16.analysis.fp32_rules import Fp32RulesAnalysis
from fx16.analysis.intervals import Source, ValueRange
from fx16.analysis.routing import RoutingAnalysis
from fx16.analysis.scale_domains import ScaleDomainsAnalysis
from fx16.analysis.underflow import UnderflowAnalysis
from fx16.analysis.unsafe_index import UnsafeIndexAnalysis
from fx16.analysis.user_reachability import UserReachabilityAnalysis
from fx16.analysis.value_range import ValueRangeAnalysis
from fx16.analysis.verdict_check import VerdictCheckAnalysis

__all__ = [
    "CalibrationAnalysis",
    "CastableInt16Analysis",
    "ConditioningAnalysis",
    "ExplicitFp32Analysis",
    "Fp32RulesAnalysis",
    "RoutingAnalysis",
    "ScaleDomainsAnalysis",
    "Source",
    "UnderflowAnalysis",
    "UnsafeIndexAnalysis",
    "UserReachabilityAnalysis",
    "ValueRange",
    "ValueRangeAnalysis",
    "VerdictCheckAnalysis",
]
