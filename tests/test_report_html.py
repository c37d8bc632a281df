"""``fx16 inspect --html``: one self-contained page, layers coloured by precision, the
reason for each fp32 value on hover; rendered in a real headless browser (Debian's
chromium; CI installs it, see .ci/run)."""

import copy
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch
from fuzz_profile import examples
from hypothesis import given, settings

import fx16
from fx16.diagnosis import diagnose
from fx16.report import report_of
from fx16.report.html import report_html
from fx16.testing import programs
from helpers import export
from models import RMSNormMLP

FP32_COLOUR, LOW_COLOUR = (0xE0, 0x7B, 0x39), (0x3A, 0x9D, 0x5D)


class _Cells(HTMLParser):
    """The value cells of a page: (classes, tooltip), and every external reference."""

    def __init__(self) -> None:
        super().__init__()
        self.cells, self.external, self.text = [], [], []

    def handle_data(self, data):
        self.text.append(data)

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if "cell" in attributes.get("class", "").split():
            self.cells.append((attributes["class"], attributes.get("title", "")))
        for name in ("src", "href"):
            if name in attributes:
                self.external.append(attributes[name])


def _cells(page: str) -> _Cells:
    parser = _Cells()
    parser.feed(page)
    return parser


def _kept_island_program():
    """An RMSNorm whose squares overflow fp16: its fp32 region stays, with a reason, when
    cast without the stable rewrites (``stabilize=False``: with them it needs no fp32)."""
    torch.manual_seed(0)
    return export(RMSNormMLP(), torch.randn(3, 16) * 300)


def test_one_cell_per_float_value_and_a_reason_on_every_fp32_cell():
    ep = fx16.cast_fp32_to_fp16(_kept_island_program(), explicit_fp32="calibrated", stabilize=False)
    report = report_of(ep)
    page = _cells(report_html(report, "norm.pt2"))
    floats = [row for row in report.rows if row.kind == "float"]
    assert len(page.cells) == len(floats)
    wide = [title for classes, title in page.cells if "precision-fp32" in classes]
    assert len(wide) == sum(not row.narrowed for row in floats) > 0
    assert all("explicit_fp32" in title and "reaches" in title for title in wide[:3])
    assert page.external == []  # self-contained: nothing to fetch


def test_every_fp32_reason_is_on_the_page_as_text_not_only_on_hover():
    report = report_of(fx16.cast_fp32_to_fp16(_kept_island_program(), stabilize=False))
    text = "".join(_cells(report_html(report, "norm.pt2")).text)
    wide = [
        r for r in report.rows if r.kind == "float" and not r.narrowed and r.rule != "left_as_is"
    ]
    assert wide and f"fp32 values and why ({len(wide)})" in text
    for row in wide:
        assert row.reason in text and row.detail in text and row.node in text


def test_a_heat_column_gives_each_layers_worst_error_against_fp32():
    reference = _kept_island_program()
    cast = fx16.cast_fp32_to_fp16(copy.deepcopy(reference))
    found = diagnose(reference, cast, [(torch.randn(3, 16) * 300,)])
    errors = {value.id: (value.error, value.amplification) for value in found.values}
    page = report_html(report_of(cast), "norm.pt2", errors)
    heats = re.findall(r'class="heat" style="background:rgb\((\d+),(\d+),(\d+)\)"', page)
    worst = max(error for error, _ in errors.values())
    assert heats and f'data-error="{worst:.3g}"' in page  # the layer holding the worst value
    assert all(int(red) == 255 for red, _, _ in heats)  # white to red
    assert "error vs fp32" in "".join(title for _, title in _cells(page).cells)
    assert 'class="heat"' not in report_html(report_of(cast), "norm.pt2")  # only when given


@settings(max_examples=examples(10), deadline=None)
@given(programs())
def test_any_cast_program_gives_one_escaped_cell_per_float_value(case):
    """Random programs (node names, reasons with <, >, quotes): the page parses back to a
    cell per float row, each cell's tooltip exactly its row's reason."""
    ep = case.export()
    fx16.cast_to_16_bit_precision(ep, input_ranges=case.input_ranges)
    report = report_of(ep)
    floats = [row for row in report.rows if row.kind == "float"]
    cells = _cells(report_html(report, "<random> & 'program'")).cells
    assert len(cells) == len(floats)
    for (classes, title), row in zip(sorted(cells, key=lambda c: c[1]), sorted(floats, key=_why)):
        assert title == _why(row)
        assert ("precision-fp32" in classes) == (not row.narrowed and row.rule != "left_as_is")


def _why(row) -> str:
    why = f"{row.node} ({row.op}): {row.dtype}, {row.rule}: {row.reason}"
    why += f": {row.detail}" if row.detail else ""
    if row.scale_exponent:  # the value a scale domain carries says so
        why += f", carried at 2**{row.scale_exponent} (a scale domain)"
    if row.chosen_by and row.chosen_by != row.rule:  # the plan's rule, where it says more
        why += f" [chosen by {row.chosen_by}]"
    return why + (f" (in fp32: {row.cost()})" if row.cost() else "")


def _chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium (.ci/run does)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    return found


def _headless(browser, *arguments, cwd):
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={cwd / 'profile'}",
    ]
    return subprocess.run(
        [browser, *flags, *arguments], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.mark.browser
def test_inspect_html_renders_in_a_headless_browser(tmp_path):
    browser = _chromium()
    source, page = tmp_path / "norm.pt2", tmp_path / "norm.html"
    torch.export.save(_kept_island_program(), source)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fx16",
            "inspect",
            str(source),
            "--no-stabilize",
            "--html",
            str(page),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    screenshot = tmp_path / "norm.png"
    shot = _headless(
        browser, f"--screenshot={screenshot}", "--window-size=1000,600", page.as_uri(), cwd=tmp_path
    )
    assert screenshot.exists(), shot.stderr
    from PIL import Image

    pixels = list(Image.open(screenshot).convert("RGB").getdata())
    assert pixels.count(FP32_COLOUR) > 20 and pixels.count(LOW_COLOUR) > 20
    dom = _headless(browser, "--dump-dom", page.as_uri(), cwd=tmp_path).stdout
    rendered = _cells(dom)  # the DOM after the page's script ran
    wide = [title for classes, title in rendered.cells if "precision-fp32" in classes]
    assert wide and all("kept" in title or "fp32" in title for title in wide)
    assert "fx16 decisions: norm.pt2" in dom
    assert "fp32 values and why" in "".join(rendered.text)  # the reasons, rendered as text
    assert "error " in "".join(rendered.text) and 'class="heat"' in dom  # errors vs fp32
