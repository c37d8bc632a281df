"""Markdown output shared by the benchmarks that write a results file."""

from pathlib import Path

import torch


def table_row(cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(cells) + " |"


def write_results(path: Path, title: str, command: str, notes: str, lines: list[str]) -> None:
    """Write ``# title``, which command produced it (with the torch version), ``notes``
    and the table ``lines`` to ``path``."""
    intro = f"Produced by `{command}` (torch {torch.__version__}, CPU). {notes}"
    path.write_text(f"# {title}\n\n{intro}\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {path}")
