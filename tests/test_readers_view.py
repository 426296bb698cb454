"""The executed reference run as a reader sees it (outputs/cpu/*.ipynb in JupyterLab or on GitHub).

Every displayed table must fit a ~1,000 px page at JupyterLab's default font (the estimate is
``page_width.table_width_px`` in tests/page_width.py, documented there), show no cell cut short with
"..." and no NaN; generated text stops at its first <eos>; figures are at most 1,000 px wide; no
nbval marker is left in a cell's source (they are cell tags).
"""

import base64
import json
import re
import struct
from pathlib import Path

import page_width
import pytest

from gemma_nb import display
from gemma_nb.paths import OUTPUTS_DIR

EXECUTED = sorted((OUTPUTS_DIR / "cpu").glob("*.ipynb"))
MISSING = {"nan", "NaN", "None", "<NA>", "NaT"}


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def outputs(path: Path):
    """(cell index, cell, output) for every output of the executed notebook."""
    notebook = json.loads(path.read_text())
    for index, cell in enumerate(notebook["cells"]):
        for output in cell.get("outputs", []):
            yield index, cell, output


def test_the_reference_run_is_there():
    assert len(EXECUTED) == 7, [p.name for p in EXECUTED]


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_tables_fit_the_page_whole(path):
    problems = []
    for index, _, output in outputs(path):
        markup = _text(output.get("data", {}).get("text/html"))
        for table in [header + body for header, body in page_width.html_table_parts(markup)]:
            cells = [cell for row in table for cell in row]
            width = page_width.table_width_px(table)
            if width > display.PAGE_WIDTH_PX:
                problems.append(f"cell {index}: table ~{width:.0f} px wide (header {table[0][:6]})")
            cut = [c for c in cells if "..." in c or "…" in c]
            if cut:
                problems.append(f"cell {index}: cut short: {cut[:3]}")
            missing = [c for c in cells if c in MISSING]
            if missing:
                problems.append(f"cell {index}: missing values shown as {sorted(set(missing))}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_generated_text_stops_at_the_first_eos(path):
    runs = re.compile(r"<eos>\s*<eos>")
    found = []
    for index, _, output in outputs(path):
        texts = [_text(output.get("text"))] + [
            _text(v) for k, v in output.get("data", {}).items() if k.startswith("text/")
        ]
        texts = [t.replace("&lt;", "<").replace("&gt;", ">") for t in texts]
        if any(runs.search(t) for t in texts):
            found.append(index)
    assert not found, f"cells {found} show runs of <eos>"


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_no_nbval_comment_in_the_readers_view(path):
    notebook = json.loads(path.read_text())
    marked = [
        i
        for i, cell in enumerate(notebook["cells"])
        if re.search(r"^# ?NBVAL_", _text(cell["source"]), re.M)
    ]
    assert not marked, (
        f"cells {marked} open with an nbval comment: use the cell tag nbval-ignore-output"
    )


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_figures_fit_the_page(path):
    wide = []
    for index, _, output in outputs(path):
        png = output.get("data", {}).get("image/png")
        if png:
            width, height = struct.unpack(">II", base64.b64decode(_text(png))[16:24])
            if width > display.PAGE_WIDTH_PX:
                wide.append((index, width))
    assert not wide, f"figures wider than {display.PAGE_WIDTH_PX} px (cell, px): {wide}"
