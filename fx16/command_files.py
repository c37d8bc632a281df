"""What the ``fx16`` commands read: program files (after the modules that register
their custom ops), input files saved with ``torch.save``, the program's example
inputs; and a run that, when the program fails on an input, says which."""

from pathlib import Path

import torch

from fx16.archive import import_modules, load_program
from fx16.errors import one_line
from fx16.program import Program


class CommandError(Exception):
    """A problem with what the user asked for, reported as one line."""


def existing_program_path(path: Path) -> Path:
    path = path.expanduser()
    if not path.exists():
        raise CommandError(f"{path} does not exist")
    if not path.is_file():
        raise CommandError(f"{path} is not a file")
    return path


def check_report_path(path: Path | None) -> None:
    if path is not None and not path.expanduser().parent.is_dir():
        raise CommandError(f"directory {path.expanduser().parent} does not exist")


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
