"""The executed reference run as a reader sees it (outputs/cpu/*.ipynb in JupyterLab or on GitHub),
with the README, REPORT.md and docs/*.md.

Every displayed table must fit a ~1,000 px page at JupyterLab's default font (the estimate is
``page_width.table_width_px`` in tests/page_width.py, documented there), show no cell cut short with
"..." and no NaN; no prose renders as maths; generated text shows no ``<eos>`` and no raw Python
repr; every legend entry of a saved figure is labelled; figures are at most 1,000 px wide; no nbval
marker is left in a cell's source (they are cell tags). REPORT.md and the README open with the
repo's answer, and REPORT.md says met or missed for every figure that has a target. notebooks/
holds no outputs, and the git filter that strips them applies to notebooks/ only.
"""

import base64
import json
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import page_width
import pytest
from markdown_it import MarkdownIt
from mdit_py_plugins.dollarmath import dollarmath_plugin

from gemma_nb import display
from gemma_nb.metrics import headline
from gemma_nb.paths import NOTEBOOKS_DIR, OUTPUTS_DIR
from gemma_nb.tools import run

REPO = NOTEBOOKS_DIR.parent
REFERENCE = OUTPUTS_DIR / "cpu"
EXECUTED = sorted(REFERENCE.glob("*.ipynb"))
SOURCES = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
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


# No prose renders as maths
# ------------------------------------------------------------------------------------------------

# CommonMark with GitHub's tables and the dollar-maths rule of the Jupyter/MyST stack, at its most
# permissive (a space or a digit may follow a $). JupyterLab finds maths before it parses markdown,
# so a backslash does not keep its $ from pairing: \$ counts as $.
MARKDOWN = MarkdownIt("commonmark").enable("table").use(dollarmath_plugin)


def maths_spans(markdown: str) -> list[str]:
    """The text of every maths span a renderer finds in ``markdown``."""
    tokens = MARKDOWN.parse(markdown.replace("\\$", "$"))
    return [
        token.content
        for block in tokens
        for token in [block, *(block.children or [])]
        if token.type.startswith("math")
    ]


def test_the_maths_reader_finds_dollar_pairs_as_jupyterlab_does():
    assert maths_spans(r"costs \$1.24 with sparse experts and \$6.38 with dense") == [
        "1.24 with sparse experts and "
    ]
    assert maths_spans("at $0.76/h, before\nat $6.49/h") == ["0.76/h, before\nat "]
    assert maths_spans("USD 1.24 and `$6.38`, `\\$0.37`; a lone $ sign") == []
    assert maths_spans("| box | $/h |\n|---|---|\n| inf2.xlarge | $0.76 |") == []


def _markdown_documents():
    """(where, markdown) for everything a reader reads as markdown: the README, REPORT.md, docs,
    every notebook's markdown cells and the markdown its cells generate."""
    for path in [
        REPO / "README.md",
        REFERENCE / "REPORT.md",
        *sorted((REPO / "docs").glob("*.md")),
    ]:
        yield path.relative_to(REPO).as_posix(), path.read_text()
    for path in [*SOURCES, *EXECUTED]:
        where = path.relative_to(REPO).as_posix()
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                yield f"{where} cell {index}", _text(cell["source"])
            for output in cell.get("outputs", []):
                yield (
                    f"{where} cell {index} output",
                    _text(output.get("data", {}).get("text/markdown")),
                )


def test_no_prose_renders_as_maths():
    """Write "USD 1.24" (or the figure in inline code), never $1.24 nor \\$1.24."""
    found = [
        f"{where}: ${span}$" for where, text in _markdown_documents() for span in maths_spans(text)
    ]
    assert not found, "prose typeset as maths:\n" + "\n".join(found)


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_no_dollar_in_a_generated_table(path):
    """JupyterLab typesets maths in HTML outputs too: tables say "USD"."""
    found = [i for i, _, o in outputs(path) if "$" in _text(o.get("data", {}).get("text/html"))]
    assert not found, f"cells {found} show a $ in a table"


# Generated text as a reader reads it
# ------------------------------------------------------------------------------------------------

# A Python container or object printed as it is: ['a', 'b'], {'bucket': 128}, np.float64(1.5),
# tensor(...), <... object at 0x...>.
RAW_REPR = re.compile(
    r"""[\[{(]\s*(['"])[^'"]*\1\s*[,:\]}]"""  # a list, dict or tuple of strings
    r"|\b(?:np\.\w+|tensor|PosixPath|OrderedDict)\(|object at 0x"
)


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: p.stem)
def test_generated_text_shows_no_eos_and_no_raw_repr(path):
    found = []
    for index, _, output in outputs(path):
        texts = [_text(output.get("text"))] + [
            _text(v) for k, v in output.get("data", {}).items() if k.startswith("text/")
        ]
        text = "\n".join(texts).replace("&lt;", "<").replace("&gt;", ">").replace("&#x27;", "'")
        if "<eos>" in text:
            found.append(f"cell {index}: <eos> (display.cut_at_eos)")
        found += [f"cell {index}: raw repr {m.group(0)!r}" for m in RAW_REPR.finditer(text)]
    assert not found, "\n".join(found)


# Figures
# ------------------------------------------------------------------------------------------------


SVG_GROUP = "{http://www.w3.org/2000/svg}g"


def legend_layouts(svg: Path) -> dict[str, str]:
    """Each legend of a figure matplotlib saved as SVG, as the parts it draws in order: "h" for a
    handle (a patch, line or collection), "t" for a text. An empty label draws no text."""
    return {
        group.get("id"): "".join(
            "t" if part.get("id", "").startswith("text_") else "h"
            for part in group.findall(SVG_GROUP)
        )
        for group in ElementTree.parse(svg).getroot().iter(SVG_GROUP)
        if group.get("id", "").startswith("legend_")
    }


# A frame (a patch) if drawn, a title if any, then each entry's handle and its label. A frameless
# legend whose first entry has no label reads as a frame and an entry here: plots.collisions
# refuses it before the figure is saved.
LABELLED_LEGEND = re.compile(r"h?t?(ht)+")


@pytest.mark.parametrize(
    "path", sorted((REFERENCE / "figures").glob("*.svg")), ids=lambda p: p.stem
)
def test_every_legend_entry_of_a_saved_figure_is_labelled(path):
    unlabelled = {
        legend: layout
        for legend, layout in legend_layouts(path).items()
        if not LABELLED_LEGEND.fullmatch(layout)
    }
    assert not unlabelled, (
        f"{path.name}: legends with unlabelled entries (h: handle, t: label): {unlabelled}"
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


# The answer first, and every target's verdict
# ------------------------------------------------------------------------------------------------


def _reference_answer() -> str:
    summary = json.loads((REFERENCE / "summary.json").read_text())
    m01, m07 = (summary["notebooks"][key]["metrics"] for key in run.ANSWER_FROM)
    return run.ANSWER.format(m01=m01, m07=m07)


def _paragraphs(markdown: str) -> list[str]:
    return [" ".join(block.split()) for block in markdown.split("\n\n")]


def test_the_readme_and_report_open_with_the_answer_of_the_reference_run():
    """The README's opening states the repo's answer with the figures of outputs/cpu/metrics, as
    REPORT.md does: regenerate the run, and this names a figure that moved."""
    answer = _reference_answer()
    readme = _paragraphs((REPO / "README.md").read_text().split("\n## ")[0])
    report = _paragraphs((REFERENCE / "REPORT.md").read_text())
    assert report[1] == answer, "REPORT.md: regenerate the reference run (python -m gemma_nb run)"
    assert answer in readme, f"README.md's opening must state the reference run's answer:\n{answer}"


def test_report_says_met_or_missed_for_every_figure_with_a_target():
    rows = [line for line in (REFERENCE / "REPORT.md").read_text().splitlines() if line[:2] == "| "]
    targeted = [row.split(" | ") for row in rows if re.search(r"\| at (least|most) ", row)]
    assert len(targeted) >= 6
    assert all(cells[-1] in ("met |", "missed |") for cells in targeted), targeted
    assert not [row for row in rows if "(target" in row], "targets are a column, not in the name"


def test_report_rows_say_their_target_and_verdict(tmp_path):
    (tmp_path / "05_deploy.ipynb").write_text("{}")
    summary = {
        "target": "cpu",
        "notebooks": {
            "05_deploy": {
                "headline": [
                    headline("slim / naive peak RSS", 0.319, "x", at_most=0.35),
                    headline("step / floor", 2.54, "x", at_most=1.5),
                    headline("same tokens", True),
                ]
            }
        },
    }
    report = run.write_report(tmp_path, summary).read_text()
    assert "| slim / naive peak RSS | 0.319 | x |  | at most 0.35x | met |" in report
    assert "| step / floor | 2.54 | x |  | at most 1.5x | missed |" in report
    assert "| same tokens | yes |  |  |  |  |" in report
    # without notebooks 01 and 07 there is no answer to state
    assert report.split("\n\n")[1].startswith("Generated by")


# notebooks/ holds the story without outputs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.stem)
def test_the_notebooks_hold_no_outputs(path):
    cells = json.loads(path.read_text())["cells"]
    kept = [i for i, c in enumerate(cells) if c.get("outputs") or c.get("execution_count")]
    assert not kept, f"{path.name}: cells {kept} keep outputs (make install strips them on git add)"


def test_git_strips_outputs_from_notebooks_only(tmp_path):
    """The filter ``make install`` configures, run by git in a scratch checkout as in any worktree:
    a notebook added with outputs is stored without them, the reference run as it is, and a
    notebook of notebooks/ passes through unchanged."""
    recipe = subprocess.run(
        ["make", "-n", "-s", "git-filter"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    settings = [
        f"{key}={shlex.split(value)[0]}"
        for key, value in re.findall(r"git config (\S+) ('[^']*'|\S+)", recipe)
    ]
    assert [s.split("=")[0] for s in settings] == [
        "filter.nbstripout.clean",
        "filter.nbstripout.smudge",
    ]
    shutil.copy(REPO / ".gitattributes", tmp_path)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # the checkout's own environment
    executed = EXECUTED[0].read_bytes()
    for folder in ("notebooks", "outputs/cpu"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "executed.ipynb").write_bytes(executed)
    shutil.copy(SOURCES[0], tmp_path / "notebooks" / SOURCES[0].name)
    git = ["git", *(arg for setting in settings for arg in ("-c", setting))]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "."], cwd=tmp_path, check=True)

    def staged(path: str) -> bytes:
        return subprocess.run(
            ["git", "show", f":{path}"], cwd=tmp_path, capture_output=True, check=True
        ).stdout

    stripped = json.loads(staged("notebooks/executed.ipynb"))
    assert not [c for c in stripped["cells"] if c.get("outputs") or c.get("execution_count")]
    assert len(stripped["cells"]) == len(json.loads(executed)["cells"])
    assert staged("outputs/cpu/executed.ipynb") == executed
    assert staged(f"notebooks/{SOURCES[0].name}") == SOURCES[0].read_bytes()
