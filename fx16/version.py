"""fx16's version, as the installed package records it (no torch import)."""

from importlib.metadata import PackageNotFoundError, version


def installed_version() -> str:
    try:
        return version("fx16")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "(not installed)"
