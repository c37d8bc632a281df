"""Loading ``.pt2`` archives (for ``fx16.load`` and the command line), with reasons a
user can act on.

``torch.export.load`` logs the real cause of a failed load and raises a generic
"We ran into an error when deserializing"; a damaged entry may even load. Here an
archive is checked (a zip file whose entries match their CRCs) before it is loaded,
and a failure is reported with torch's own reason in one line. Output types a model
returns (every transformers model returns a ``ModelOutput`` subclass) must be
registered with pytree, and custom ops it calls (transformers' MoE layers call
``torch.ops.transformers.grouped_mm_fallback``) registered with torch, before their
programs deserialize: the module that defines such a type is imported by its recorded
name, the module of the op's package that registers it is found by its source, or the
user names it (``--import MODULE``, ``fx16.load(path, imports=[...])``).
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
_UNRESOLVED_OP = re.compile(r"failed to resolve torch\.ops\.(\w+)\.(\w+)\.\w+ to an operator")


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
            missing_type = _UNREGISTERED.search(failure.reason)
            missing_op = _UNRESOLVED_OP.search(failure.reason)
            if missing_type:
                module = missing_type.group(1).rpartition(".")[0]
            else:
                module = _registering_module(*missing_op.groups()) if missing_op else ""
            if not module or module in imported or not _importable(module):
                raise ArchiveError(f"cannot load {path}: {_said(failure.reason)}") from None
            imported.add(module)
            import_modules([module])


def _said(reason: str) -> str:
    """torch's reason for a failed load, with the step a user takes where one helps."""
    missing_op = _UNRESOLVED_OP.search(reason)
    if missing_op:  # torch's reason runs on with the whole node (kilobytes)
        namespace, op = missing_op.groups()
        return (
            f"it calls the custom op torch.ops.{namespace}.{op}, which no imported module "
            "registers; pass --import MODULE (fx16.load(path, imports=[...])) for the "
            "module that does"
        )
    if _UNREGISTERED.search(reason):
        return f"{reason.rstrip('.')}; pass --import MODULE for the module that does"
    return reason


def _registering_module(namespace: str, op: str) -> str:
    """The module of the installed package ``namespace`` whose source registers the
    custom op ``namespace::op`` ("" if none does)."""
    spec = importlib.util.find_spec(namespace) if _importable(namespace) else None
    if spec is None or not spec.submodule_search_locations:
        return ""
    names = (f'"{namespace}::{op}"', f"'{namespace}::{op}'")
    for location in spec.submodule_search_locations:
        root = Path(location)
        for source in sorted(root.rglob("*.py")):
            try:
                text = source.read_text(encoding="utf-8", errors="ignore")
            except OSError:
                continue
            if any(name in text for name in names):
                parts = source.relative_to(root).with_suffix("").parts
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                return ".".join((namespace, *parts))
    return ""


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
