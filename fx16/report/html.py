"""The decision report as one self-contained HTML page (``fx16 inspect --html``).

The page needs no network: styles and the few lines of script are inline. Each
layer of the program (module path up to its index, "model.layers.3") is a row of
cells, one per float value in graph order, coloured by the precision fx16 chose;
hovering a cell shows the value's node, op, dtype, rule and reason - for an fp32
value, why it stays fp32 and what that costs. The totals head the page, the share
of matmul/conv/attention FLOPs in 16-bit first, and each layer gives its own; a
button hides the 16-bit cells. Below the layers, a table lists every fp32 value
with its rule, cost and reason in plain text (readable without hovering, printable,
searchable); clicking an fp32 cell jumps to its line there.

Given the per-node errors against fp32 (``fx16.diagnose``), each layer gets a heat
column, its worst relative error, white below 16-bit rounding and deepening to red
at 100%; each cell's text says its own error and amplification.
"""

import html
import math

from fx16.report import CastReport, layer_flop_share
from fx16.report.rows import Row

_COLOURS = {"16-bit": "#3a9d5d", "fp32": "#e07b39", "left as is": "#9aa0a6"}

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #202124; }
h1 { font-size: 20px; margin: 0 0 8px; }
.totals { margin: 0 0 16px; padding: 0; list-style: none; }
.legend span { display: inline-block; margin-right: 16px; }
.legend i, .cell { display: inline-block; width: 14px; height: 14px; border-radius: 2px; }
.legend i { vertical-align: -2px; margin-right: 4px; }
table { border-collapse: collapse; margin-top: 12px; }
td { padding: 3px 8px; vertical-align: top; border-bottom: 1px solid #eee; }
td.layer { font-family: ui-monospace, monospace; white-space: nowrap; }
td.counts { white-space: nowrap; color: #5f6368; }
td.heat { white-space: nowrap; font-variant-numeric: tabular-nums; }
.cell { margin: 1px; cursor: help; }
.cell:hover { outline: 2px solid #202124; }
body.fp32-only .cell.precision-16-bit { visibility: hidden; }
h2 { font-size: 16px; margin: 24px 0 4px; }
table.reasons td { font-size: 13px; }
table.reasons td.node { font-family: ui-monospace, monospace; }
table.reasons tr:target { background: #fde7d7; }
#tip { position: fixed; pointer-events: none; background: #202124; color: #fff;
       padding: 6px 8px; border-radius: 4px; max-width: 520px; display: none; }
"""

_SCRIPT = """
const tip = document.getElementById('tip');
document.querySelectorAll('.cell').forEach(cell => {
  cell.addEventListener('mousemove', event => {
    tip.textContent = cell.dataset.why;
    tip.style.display = 'block';
    tip.style.left = (event.clientX + 12) + 'px';
    tip.style.top = (event.clientY + 12) + 'px';
  });
  cell.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
  cell.addEventListener('click', () => {
    const line = document.getElementById('why-' + cell.dataset.node);
    if (line) { location.hash = line.id; }
  });
});
document.getElementById('only-fp32').addEventListener('click', () => {
  document.body.classList.toggle('fp32-only');
});
"""


def report_html(report: CastReport, title: str, errors: dict | None = None) -> str:
    """The page for ``report`` of the program named ``title``; ``errors``: each node's
    (relative error, amplification) against fp32 by name, for the heat column."""
    layers = report.layers()
    legend = "".join(
        f'<span><i style="background:{colour}"></i>{name}</span>'
        for name, colour in _COLOURS.items()
    )
    totals = "".join(f"<li>{html.escape(line)}</li>" for line in report.summary())
    body = "".join(_layer_row(name, rows, errors) for name, rows in layers.items())
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>fx16: {html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>"
        f"<h1>fx16 decisions: {html.escape(title)}</h1>"
        f'<ul class="totals">{totals}</ul>'
        f'<div class="legend">{legend}<button id="only-fp32">show only fp32</button></div>'
        f'<table><tbody id="layers">{body}</tbody></table>'
        f"{_reasons(report)}"
        f'<div id="tip"></div><script>{_SCRIPT}</script></body></html>\n'
    )


def _reasons(report: CastReport) -> str:
    """Every fp32 float value, with its rule, what fp32 costs, and why, as a table."""
    rows = [row for row in report.explained() if _precision(row) == "fp32"]
    lines = "".join(
        f'<tr id="why-{html.escape(row.node)}"><td class="node">{html.escape(row.node)}</td>'
        f"<td>{html.escape(row.module or '-')}</td><td>{html.escape(row.op)}</td>"
        f"<td>{html.escape(row.rule)}</td><td>{html.escape(row.cost() or '-')}</td>"
        f"<td>{html.escape(row.why())}</td></tr>"
        for row in rows
        if row.kind == "float"
    )
    columns = ("node", "module", "op", "rule", "fp32 cost", "why")
    header = "<tr>" + "".join(f"<th>{name}</th>" for name in columns) + "</tr>"
    title = f"<h2>fp32 values and why ({len(rows)})</h2>"
    return f'{title}<table class="reasons"><thead>{header}</thead><tbody>{lines}</tbody></table>'


def _precision(row: Row) -> str:
    if row.rule == "left_as_is":
        return "left as is"
    return "16-bit" if row.narrowed else "fp32"


def _layer_row(name: str, rows: list[Row], errors: dict | None) -> str:
    wide = sum(_precision(row) == "fp32" for row in rows)
    cells = "".join(_cell(row, errors) for row in rows)
    share = layer_flop_share(rows)
    flops = f"{share} of matmul/conv/attention FLOPs 16-bit, " if share != "-" else ""
    heat = ""
    if errors is not None:
        worst = max((errors[row.node][0] for row in rows if row.node in errors), default=None)
        heat = _heat_cell(worst)
    return (
        f'<tr data-layer="{html.escape(name)}"><td class="layer">{html.escape(name)}</td>'
        f'<td class="counts">{flops}{len(rows) - wide} 16-bit, {wide} fp32</td>'
        f"{heat}<td>{cells}</td></tr>"
    )


def _heat_cell(error: float | None) -> str:
    """The layer's worst error vs fp32, as text on a white (<= 2**-11) to red (>= 1) ground."""
    if error is None:
        return '<td class="heat">-</td>'
    if math.isfinite(error):
        depth = min(max((math.log10(max(error, 1e-12)) + 3.3) / 3.3, 0.0), 1.0)
    else:
        depth = 1.0
    ground = f"rgb(255,{round(255 * (1 - depth))},{round(255 * (1 - depth))})"
    return (
        f'<td class="heat" style="background:{ground}" data-error="{error:.3g}">'
        f"error {error:.3g}</td>"
    )


def _cell(row: Row, errors: dict | None = None) -> str:
    precision = _precision(row)
    why = f"{row.node} ({row.op}): {row.dtype}, {row.rule}: {row.why()}"
    if errors is not None and row.node in errors:
        error, amplification = errors[row.node]
        why += f"; error vs fp32 {error:.3g} (amplifies {amplification:.3g}x)"
    if row.cost():
        why += f" (in fp32: {row.cost()})"
    return (
        f'<span class="cell precision-{precision.replace(" ", "-")}" '
        f'style="background:{_COLOURS[precision]}" data-node="{html.escape(row.node)}" '
        f'data-why="{html.escape(why)}" title="{html.escape(why)}"></span>'
    )
