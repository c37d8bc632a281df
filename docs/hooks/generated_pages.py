"""mkdocs hook: the pages generated from the code and the benchmarks, so they cannot drift.

- ``benchmarks/NAME.md``: each table as the benchmark that writes it left it;
- ``reference/rules.md``: fx16's rule registries in their order (the safety rules,
  the stable rewrites, the cleanup rules, the planner's precedence lists), each rule
  with its docstring (what it guards, before and after, what it costs);
- ``reference/cli.md``: the ``fx16`` command's options, from its argparse parser;
- in ``architecture.md``, the import-linter contracts as ``pyproject.toml`` states them.

And, run as a script (``python docs/hooks/generated_pages.py``), the "what stays fp32"
tables of ``README.md``, ``docs/index.md`` and the guide's what-is-cast page, from the
reasons' specs (``fx16.decisions.REASON_SPECS``); ``tests/test_reason_specs.py`` fails
while one is out of date.
"""

import inspect
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]


def on_files(files, config):
    for table in sorted((ROOT / "benchmarks").glob("*.md")):
        files.append(File.generated(config, f"benchmarks/{table.name}", content=table.read_text()))
    files.append(File.generated(config, "reference/rules.md", content=rules_page()))
    files.append(File.generated(config, "reference/cli.md", content=cli_page()))
    return files


CONTRACTS = "<!-- import-linter contracts -->"


def on_page_markdown(markdown, page, config, files):
    if CONTRACTS not in markdown:
        return markdown
    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("[tool.importlinter]")
    end = text.index("\n[tool.", start + 1)
    return markdown.replace(CONTRACTS, "```toml\n" + text[start:end].strip() + "\n```")


def _section(title: str, intro: str, rules) -> list[str]:
    lines = [f"## {title}", "", intro, ""]
    for position, rule in enumerate(rules, 1):
        kind = rule if isinstance(rule, type) else type(rule)
        lines += [f"### {position}. `{kind.__name__}`", ""]
        reason = getattr(rule, "reason", None)
        if reason is not None:
            lines += [f"Reason in the report: `{reason.name.lower()}` ({reason.value}).", ""]
        marks = getattr(rule, "marks", None)
        if marks:
            lines += ["Writes: " + ", ".join(f'`meta["{mark}"]`' for mark in marks) + ".", ""]
        lines += [inspect.cleandoc(kind.__doc__ or ""), ""]
    return lines


def rules_page() -> str:
    import torch

    from fx16.analysis.fp32_rules import Fp32RulesAnalysis
    from fx16.passes.cleanup_casts import STANDARD_RULES
    from fx16.passes.stabilize import standard_rules
    from fx16.plan.graph_inputs import STATE_RULES, USER_INPUT_RULES
    from fx16.plan.precedence import CAST_TO_FP32_RULES, COMPUTE_RULES, CREATION_RULES

    lines = [
        "# Rules",
        "",
        "Generated from the registries the pipeline runs (`mkdocs build` reads them), in",
        "the order they are tried.",
        "",
    ]
    lines += _section(
        "Safety rules (`Fp32RulesAnalysis.standard`)",
        "Each node gets the first rule that keeps it fp32; the report names it.",
        Fp32RulesAnalysis.standard(torch.float16, 65504 / 2).rules,
    )
    lines += _section(
        "Stable rewrites (`fx16.passes.stabilize.standard_rules`)",
        "Exact in real arithmetic and on by default, except `EpsClamp` (`eps_clamp=True`),"
        " which changes results.",
        standard_rules(torch.float16, exact=True, eps_clamp=True),
    )
    lines += _section(
        "Cleanup rules (`fx16.passes.cleanup_casts.STANDARD_RULES`)",
        "Run to a fixed point after the casts are inserted; each keeps every value's dtype."
        " They cost nothing: they remove casts.",
        STANDARD_RULES,
    )
    lines += ["## The planner's precedence lists (`fx16.plan.precedence`)", ""]
    for name, rules in (
        ("compute ops", COMPUTE_RULES),
        ("the model's casts to fp32", CAST_TO_FP32_RULES),
        ("creation ops", CREATION_RULES),
        ("state tensors (`fx16.plan.graph_inputs`)", STATE_RULES),
        ("user inputs (`fx16.plan.graph_inputs`)", USER_INPUT_RULES),
    ):
        lines += [f"### For {name}", "", "| # | rule | what it decides |", "|---|---|---|"]
        for position, rule in enumerate(rules, 1):
            said = " ".join(inspect.cleandoc(rule.test.__doc__ or "").split())
            lines.append(f"| {position} | `{rule.name}` | {said or '-'} |")
        lines.append("")
    return "\n".join(lines)


def cli_page() -> str:
    from fx16.cli import build_parser

    parser = build_parser()
    lines = ["# Command-line options", "", "Generated from the `fx16` command's parser.", ""]
    lines += ["```", parser.format_help().rstrip(), "```", ""]
    subcommands = parser._subparsers._group_actions[0].choices  # argparse keeps them here
    for name, subparser in subcommands.items():
        lines += [f"## fx16 {name}", "", "```", subparser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


TABLE_PAGES = ("README.md", "docs/index.md", "docs/guide/what-is-cast.md")
TABLE_START = "<!-- what stays fp32: written by python docs/hooks/generated_pages.py -->"
TABLE_END = "<!-- end of the written table -->"
# the order of the table's rows: causes of a kind together, the model's and the caller's last
TABLE_FAMILIES = ("safety", "range", "precision", "model", "choice")


def fp32_table() -> str:
    """The "what stays fp32" table: a row per cause a reason's spec states (reasons with
    the same cause share one), grouped by family."""
    from fx16.decisions import REASON_SPECS

    rows: dict[tuple[str, str], list[str]] = {}
    for family in TABLE_FAMILIES:
        for reason, spec in REASON_SPECS.items():
            if spec.family == family and spec.cause:
                rows.setdefault((spec.cause, spec.instead), []).append(reason.name.lower())
    lines = ["| cause | the rule | instead, where it can |", "|---|---|---|"]
    for (cause, instead), names in rows.items():
        lines.append(f"| {cause} | {', '.join(f'`{name}`' for name in names)} | {instead} |")
    return "\n".join(lines)


def with_table(text: str) -> str:
    """``text`` with the block between the table's markers written anew."""
    start = text.index(TABLE_START) + len(TABLE_START)
    end = text.index(TABLE_END, start)
    return text[:start] + "\n" + fp32_table() + "\n" + text[end:]


if __name__ == "__main__":
    for page in TABLE_PAGES:
        path = ROOT / page
        path.write_text(with_table(path.read_text()))
