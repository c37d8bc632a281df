"""fx16's version, as the installed package records it (no torch import)."""

import functools
from importlib.metadata import PackageNotFoundError, version


@functools.cache  # reading the installed metadata takes milliseconds; it does not change
def installed_version() -> str:
    try:
        return version("fx16")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "(not installed)"
