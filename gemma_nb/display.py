"""How an executed notebook looks to its reader: one ``setup_page()`` in every notebook's first code cell.

The page is JupyterLab at its default settings (or GitHub's notebook view) about 1,000 px wide.
``setup_page()`` makes every DataFrame a notebook shows fit that page and read cleanly:

- no cell is cut short with "..." (pandas' default cuts text at 50 characters);
- floats carry about four significant digits (``format_float``), never ``1.646104e+07``;
- ``True``/``False`` (also as the strings ``"true"``/``"True"``) read "yes"/"no", and a missing value is a blank cell, not ``NaN`` or ``None``;
- generated text stops at its first ``<eos>`` (``cut_at_eos``): the tokens a model keeps emitting
  after its end-of-sequence token are noise, not an answer.

Table width is estimated from the text of its cells (``table_width_px``), the same way for a
DataFrame before it is shown and for the HTML table stored in an executed notebook
(``html_tables``), so ``tests/test_readers_view.py`` can hold every executed notebook to the page.
The estimate, for JupyterLab's default theme (tables in a 12 px sans-serif font, 0.5 em of padding
either side of a cell): each column is as wide as its widest cell, at ``CHAR_WIDTH_PX`` per
character plus ``CELL_PADDING_PX``; text that contains spaces wraps, so it counts at most
``WRAP_CHARS`` characters (or its longest word, if that is longer). ``CHAR_WIDTH_PX`` is the
advance of a digit in Helvetica/Arial at 12 px (6.7 px) rounded up, so the estimate errs wide.
"""

from __future__ import annotations

import html.parser
import math
import re
from typing import Any, Iterable

PAGE_WIDTH_PX = 1000
CHAR_WIDTH_PX = 7.0
CELL_PADDING_PX = 12.0
WRAP_CHARS = 40
PAGE_WIDTH_IN = 10.0  # a figure at matplotlib's 100 dpi inline: 10 in = 1,000 px
EOS = "<eos>"
MAX_ROWS = 120


def cut_at_eos(text: str, eos: str = EOS) -> str:
    """``text`` up to and including its first ``eos``: "Paris.<eos><eos>..." -> "Paris.<eos>"."""
    index = text.find(eos)
    return text if index < 0 else text[: index + len(eos)]


def format_float(value: float) -> str:
    """A float as a reader wants it: about four significant digits, thousands separated, no exponent
    unless the value is tiny; integral values without decimals; NaN as a blank."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    value = float(value)
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    magnitude = abs(value)
    if value == 0.0:
        return "0"
    if magnitude >= 1e4 or value == round(value):
        return f"{value:,.0f}"
    if magnitude < 1e-4:
        return f"{value:.3e}"
    decimals = max(0, 3 - math.floor(math.log10(magnitude)))
    text = f"{value:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_cell(value: Any) -> str:
    """One table cell as shown: bools as yes/no, missing as blank, floats by ``format_float``,
    large integers with thousands separators, text cut at its first ``<eos>``."""
    import numpy as np

    if value is None:
        return ""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        return format_float(float(value))
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}" if abs(int(value)) >= 10_000 else str(int(value))
    if isinstance(value, str):
        # a boolean that went through str() or JSON on its way into a table reads as a word too
        if value in ("True", "true", "False", "false"):
            return "yes" if value.lower() == "true" else "no"
        return cut_at_eos(value)
    try:
        import pandas as pd

        if pd.isna(value):
            return ""
    except (TypeError, ValueError):
        pass
    return cut_at_eos(str(value))


def tidy(frame):
    """A copy of ``frame`` (DataFrame or Series) with every cell and index label formatted for the page.

    The result holds strings only, so what the reader sees does not depend on pandas' options.
    """
    import pandas as pd

    if isinstance(frame, pd.Series):
        return tidy(frame.to_frame()).iloc[:, 0].rename(frame.name)
    shown = frame.map(format_cell)
    shown.index = _tidy_index(frame.index)
    shown.columns = _tidy_index(frame.columns)
    return shown


def _tidy_index(index):
    import pandas as pd

    if isinstance(index, pd.MultiIndex):
        return pd.MultiIndex.from_tuples([tuple(format_cell(v) for v in labels) for labels in index],
                                         names=index.names)
    if isinstance(index, pd.RangeIndex):
        return index
    return pd.Index([format_cell(v) for v in index], name=index.name)


def cell_width_chars(text: str) -> int:
    """How many characters of ``text`` set its column's width (text with spaces wraps)."""
    lines = str(text).splitlines() or [""]
    widest = 0
    for line in lines:
        line = line.strip()
        if " " in line:
            longest_word = max(len(word) for word in line.split())
            widest = max(widest, min(len(line), max(longest_word, WRAP_CHARS)))
        else:
            widest = max(widest, len(line))
    return widest


def table_width_px(rows: Iterable[Iterable[str]]) -> float:
    """Estimated rendered width of a table given as rows of cell texts (header rows included)."""
    widths: dict[int, int] = {}
    for row in rows:
        for column, text in enumerate(row):
            widths[column] = max(widths.get(column, 0), cell_width_chars(text))
    return sum(chars * CHAR_WIDTH_PX + CELL_PADDING_PX for chars in widths.values())


def frame_rows(frame) -> list[list[str]]:
    """The cell texts a DataFrame shows, header row(s) and index column(s) included."""
    import pandas as pd

    shown = tidy(frame) if isinstance(frame, (pd.DataFrame, pd.Series)) else frame
    if isinstance(shown, pd.Series):
        shown = shown.to_frame()
    index_levels = shown.index.nlevels
    header_levels = shown.columns.nlevels
    rows = []
    for level in range(header_levels):
        labels = [str(c[level]) if header_levels > 1 else str(c) for c in shown.columns]
        rows.append([""] * index_levels + labels)
    for labels, values in zip(shown.index, shown.itertuples(index=False)):
        labels = labels if isinstance(labels, tuple) else (labels,)
        rows.append([str(v) for v in labels] + [str(v) for v in values])
    return rows


def frame_width_px(frame) -> float:
    """Estimated width of ``frame`` as ``setup_page()`` shows it in JupyterLab."""
    return table_width_px(frame_rows(frame))


class _TableParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._depth = 0
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._colspan = 1

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._depth += 1
            self.tables.append([])
        elif tag == "tr" and self._depth:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
            self._colspan = int(dict(attrs).get("colspan") or 1)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            text = re.sub(r"\s+", " ", "".join(self._cell)).strip()
            # a cell spanning several columns does not set any one column's width
            self._row.extend([text] if self._colspan == 1 else [""] * self._colspan)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self._row = None
        elif tag == "table" and self._depth:
            self._depth -= 1

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def html_tables(markup: str) -> list[list[list[str]]]:
    """Every ``<table>`` in ``markup`` as rows of cell texts (``th`` and ``td``)."""
    parser = _TableParser()
    parser.feed(markup)
    return parser.tables


def _html(frame) -> str:
    shown = tidy(frame)
    if not hasattr(shown, "to_html"):
        shown = shown.to_frame()
    return shown.to_html(max_rows=MAX_ROWS, notebook=True)


def _plain(frame, printer, cycle) -> None:
    printer.text(tidy(frame).to_string(max_rows=MAX_ROWS))


def setup_page() -> None:
    """Pandas options, IPython table formatters and the plot theme for a notebook; idempotent.

    Call it first thing in a notebook. Outside IPython only the pandas options are set.
    """
    import pandas as pd

    pd.set_option("display.max_colwidth", None)
    pd.set_option("display.max_columns", None)
    pd.set_option("display.max_rows", MAX_ROWS)
    pd.set_option("display.width", int(PAGE_WIDTH_PX / CHAR_WIDTH_PX))
    pd.set_option("display.float_format", format_float)
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython ships with the notebook stack
        return
    shell = get_ipython()
    if shell is None:
        return
    formatters = shell.display_formatter.formatters
    for kind in (pd.DataFrame, pd.Series):
        formatters["text/html"].for_type(kind, _html)
        formatters["text/plain"].for_type(kind, _plain)
    from gemma_nb import plots

    plots.set_theme()
