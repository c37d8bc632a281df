"""Loading ``.pt2`` archives for the command line, with reasons a user can act on.

``torch.export.load`` logs the real cause of a failed load and raises a generic
"We ran into an error when deserializing"; a damaged entry may even load. Here an
archive is checked (a zip file whose entries match their CRCs) before it is loaded,
and a failure is reported with torch's own reason. Output types a model returns
(every transformers model returns a ``ModelOutput`` subclass) must be registered with
pytree before their programs deserialize; the module that defines such a type is
imported by its recorded name, or named by the user (``--import MODULE``).
"""

import importlib
import importlib.util
import logging
import re
import zipfile
from pathlib import Path

import torch

from fx16.errors import Fx16Error, one_line

_UNREGISTERED = re.compile(r"Deserializing (\S+) in pytree is not registered")


class ArchiveError(Fx16Error):
    """A ``.pt2`` file that cannot be read, with the reason in one line."""


def import_modules(names: list[str]) -> None:
    """Import each module in ``names`` (their import registers types with pytree)."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:
            raise ArchiveError(f"cannot import {name}: {type(error).__name__}: {error}") from error


def check_archive(path: Path) -> None:
    """Raise ArchiveError unless ``path`` is a zip file whose entries match their CRCs."""
    if not zipfile.is_zipfile(path):
        raise ArchiveError(f"{path} is not a .pt2 archive (torch.export.save writes a zip file)")
    try:
        with zipfile.ZipFile(path) as archive:
            damaged, names = archive.testzip(), archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise ArchiveError(f"{path} is damaged: {error}") from error
    if damaged is not None:
        raise ArchiveError(f"{path} is damaged: the CRC of {damaged} does not match its data")
    if _written_by_torch_save(names):
        raise ArchiveError(
            f"{path} is a file written by torch.save (tensors or inputs), not a program "
            "written by torch.export.save; pass it as --calibrate or --inputs"
        )


def _written_by_torch_save(names: list[str]) -> bool:
    """A torch.save zip holds ``<name>/data.pkl`` and ``<name>/version``; a .pt2
    archive holds ``archive_format``."""
    entries = {name.partition("/")[2] for name in names}
    return {"data.pkl", "version"} <= entries and "archive_format" not in entries


def load_program(path: Path) -> torch.export.ExportedProgram:
    """``torch.export.load(path)``, after ``check_archive``, importing the modules of
    unregistered output types it records; ArchiveError with torch's reason otherwise."""
    check_archive(path)
    imported: set[str] = set()
    while True:
        try:
            return _load_logging_the_cause(path)
        except _LoadFailure as failure:
            missing = _UNREGISTERED.search(failure.reason)
            module = missing.group(1).rpartition(".")[0] if missing else ""
            if not module or module in imported or not _importable(module):
                reason = failure.reason
                if missing:
                    reason = f"{reason.rstrip('.')}; pass --import MODULE for the module that does"
                raise ArchiveError(f"cannot load {path}: {reason}") from None
            imported.add(module)
            import_modules([module])


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class _LoadFailure(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Recorder(logging.Handler):
    """Keeps the exceptions torch.export logs while it loads."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.errors.append(record.exc_info[1])


def _load_logging_the_cause(path: Path) -> torch.export.ExportedProgram:
    log = logging.getLogger("torch.export")
    recorder, handlers, propagate = _Recorder(), log.handlers, log.propagate
    # torch's traceback is summarised in our one line instead of printed
    log.handlers, log.propagate = [recorder], False
    try:
        return torch.export.load(path)
    except Exception as error:  # torch raises many kinds for an archive it cannot read
        raise _LoadFailure(_reason(recorder.errors[-1] if recorder.errors else error)) from error
    finally:
        log.handlers, log.propagate = handlers, propagate


def _reason(error: BaseException) -> str:
    """The innermost cause of ``error``, as "Type: first line of its message"."""
    seen = set()
    while (error.__cause__ or error.__context__) is not None and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return one_line(error)
