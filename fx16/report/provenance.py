"""What made a cast, as JSON values: the report's ``provenance``.

fx16 and torch versions, the entry point, and every option it was given - a policy by
its settings, calibration inputs by their count - so that a report read later says
how to make the same cast again.
"""

import torch

from fx16.policy import PrecisionPolicy
from fx16.program.nodes import dtype_name
from fx16.version import installed_version


def provenance(entry_point: str, options: dict) -> dict:
    """What made a cast, as JSON values: versions, the entry point and its options."""
    return {
        "fx16": installed_version(),
        "torch": torch.__version__,
        "entry_point": entry_point,
        "options": {name: _option_value(value) for name, value in options.items()},
    }


def _option_value(value):
    """An option as a JSON value: a policy by its settings, calibration by its size."""
    if isinstance(value, PrecisionPolicy):
        settings = {
            "name": value.name,
            "low": dtype_name(value.low),
            "explicit_fp32": value.explicit_fp32,
            "routing": value.routing,
            "keep_io_types": value.keep_io_types
            if isinstance(value.keep_io_types, bool)
            else sorted(map(str, value.keep_io_types)),
            "predicate": value.predicate is not None,
            "precision_tolerance": value.precision_tolerance,
        }
        tables = ("kinds", "ops", "modules", "nodes")
        return settings | {
            t: {getattr(k, "value", k): p.value for k, p in getattr(value, t).items()}
            for t in tables
        }
    if isinstance(value, (list, tuple)):
        if all(isinstance(item, (str, int, float)) for item in value):
            return list(value)  # a range
        return f"{len(value)} input(s)"  # calibration calls
    if isinstance(value, (frozenset, set)):
        return sorted(map(str, value))
    if isinstance(value, dict):
        return {str(k): _option_value(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value):  # a metric
        return getattr(value, "__qualname__", repr(value))
    return repr(value)
