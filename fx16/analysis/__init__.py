"""Analyses: passes that change no node and publish findings in ``node.meta["fx16.*"]``."""

from fx16.analysis.calibration import CalibrationAnalysis

__all__ = ["CalibrationAnalysis"]
