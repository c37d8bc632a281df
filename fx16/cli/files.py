"""What the ``fx16`` commands read: program files (after the modules that register
their custom ops), input files saved with ``torch.save``, the program's example
inputs; and a run that, when the program fails on an input, says which."""

from pathlib import Path

import torch

from fx16.errors import one_line
from fx16.program import Program
from fx16.program.archive import import_modules, load_program


class CommandError(Exception):
    """A problem with what the user asked for, reported as one line."""


def existing_program_path(path: Path) -> Path:
    path = path.expanduser()
    if not path.exists():
        raise CommandError(f"{path} does not exist")
    if not path.is_file():
        raise CommandError(f"{path} is not a file")
    return path


def writable_program_path(path: Path, source: Path, force: bool) -> Path:
    """``-o``'s path, checked before anything runs: a writable file (``writable_path``),
    not the input without --force."""
    target = path.expanduser()
    if target.exists() and target.resolve() == source.resolve() and not force:
        raise CommandError(f"{target} is the input file; pass --force to overwrite it")
    return writable_path(target, "-o", "OUT.pt2")


def writable_path(path: Path | None, flag: str, example: str) -> Path | None:
    """The path ``flag`` names, checked before anything loads: a file in an existing
    directory that can be written, not a directory or a device. None stays None."""
    if path is None:
        return None
    target = path.expanduser()
    if target.is_dir():
        raise CommandError(
            f"{flag} {target} is a directory: name the file to write ({flag} DIR/{example})"
        )
    if target.exists() and not target.is_file():
        raise CommandError(f"{flag} {target} is not a regular file: name a file to write")
    if not target.parent.is_dir():
        raise CommandError(f"{flag}: directory {target.parent} does not exist")
    existed = target.exists()
    try:  # open it as the writer will, before the cast runs (os.access trusts root)
        with open(target, "ab"):
            pass
    except OSError as error:
        raise CommandError(f"{flag} {target} cannot be written: {one_line(error)}") from error
    finally:
        if not existed and target.exists():
            target.unlink()
    return target


def save_program(ep, target: Path) -> None:
    """Save ``ep`` to ``target``; a failure to write (a full disk) is one line."""
    try:
        torch.export.save(ep, target)
    except (OSError, RuntimeError) as error:  # torch's file writer raises RuntimeError
        raise CommandError(f"cannot write {target}: {one_line(error)}") from error


def load_with_imports(path: Path, args):
    """The program in ``path``, after importing the modules ``--import`` names."""
    import_modules(args.imports)
    return load_program(path)


def read_inputs(path: Path) -> list[tuple[tuple, dict]]:
    if not path.exists():
        raise CommandError(f"{path} does not exist")
    try:
        loaded = torch.load(path, weights_only=False)
    except Exception as error:
        raise CommandError(
            f"cannot read inputs from {path}: expected a list of input tuples saved with "
            f"torch.save ({one_line(error)})"
        ) from error
    entries = loaded if isinstance(loaded, list) else [loaded]
    if not entries:
        raise CommandError(f"{path} holds an empty list: it needs at least one input tuple")
    calls = []
    for entry in entries:
        if isinstance(entry, torch.Tensor):
            entry = (entry,)
        if not isinstance(entry, (tuple, list)):
            raise CommandError(
                f"{path} must hold a list of input tuples, found {type(entry).__name__}"
            )
        calls.append((tuple(entry), {}))
    return calls


def example_calls(ep) -> list[tuple[tuple, dict]]:
    return [ep.example_inputs] if ep.example_inputs is not None else []


def run_or_name_input(ep, call: tuple[tuple, dict], label: str) -> list:
    """``ep``'s outputs on ``call``; one line naming the input if the program fails on it
    (an id past the vocabulary, ...), whatever the type of its complaint."""
    try:
        return Program.of(ep).run(*call)
    except Exception as error:
        raise CommandError(f"{label}: the program fails on it: {one_line(error)}") from error
