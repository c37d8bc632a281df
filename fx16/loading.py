"""``fx16.load``: a ``.pt2`` program with what it needs imported and its fx16 decisions
restored."""

from pathlib import Path

import torch

from fx16.program.archive import import_modules, load_program
from fx16.report.saved import restore_decisions


def load(path, imports=()) -> torch.export.ExportedProgram:
    """The program in the ``.pt2`` file at ``path``, cast by fx16 or not.

    ``torch.export.load`` after the archive is checked, with the modules its output
    types and custom ops need imported (``imports``: modules to import first, as the
    command line's ``--import``), and an fx16 cast's decisions restored on its nodes, so
    ``fx16.report.report_of`` gives its report. Raises ``ArchiveError`` (an
    ``Fx16Error``) with the reason in one line."""
    if isinstance(imports, str):
        imports = [imports]
    import_modules(list(imports))
    ep = load_program(Path(path))
    restore_decisions(ep.graph_module)
    return ep
