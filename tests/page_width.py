"""How wide a table renders on the readers' ~1,000 px JupyterLab page, estimated from its cell
texts; the readers'-view tests (test_readers_view, test_story_notebooks) check every executed
notebook with it."""

import html.parser
import re
from collections.abc import Iterable

from gemma_nb.display import CHAR_WIDTH_PX

HEADER_CHAR_WIDTH_PX = 7.7  # header cells are bold: 10% wider
CELL_PADDING_PX = 12.0
WRAP_CHARS = 40


def cell_width_chars(text: str) -> int:
    """How many characters of ``text`` set its column's width (text with spaces wraps)."""

    def width(line: str) -> int:
        line = line.strip()
        return (
            min(len(line), max(max(len(word) for word in line.split()), WRAP_CHARS))
            if " " in line
            else len(line)
        )

    return max(width(line) for line in str(text).splitlines() or [""])


def table_width_px(rows: Iterable[Iterable[str]], header_rows: int = 0) -> float:
    """Estimated rendered width of a table given as rows of cell texts, the first ``header_rows``
    bold."""
    widths: dict[int, float] = {}
    for index, row in enumerate(rows):
        char_px = HEADER_CHAR_WIDTH_PX if index < header_rows else CHAR_WIDTH_PX
        for column, text in enumerate(row):
            widths[column] = max(widths.get(column, 0.0), cell_width_chars(text) * char_px)
    return sum(px + CELL_PADDING_PX for px in widths.values())


class _TableParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.header_rows: list[int] = []  # per table: how many of its rows are in <thead>
        self._in_head, self._depth, self._colspan, self._row, self._cell = False, 0, 1, None, None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._depth += 1
            self.tables.append([])
            self.header_rows.append(0)
        elif tag == "thead":
            self._in_head = True
        elif tag == "tr" and self._depth:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell, self._colspan = [], int(dict(attrs).get("colspan") or 1)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            text = re.sub(r"\s+", " ", "".join(self._cell)).strip()
            # a cell spanning several columns does not set any one column's width
            self._row.extend([text] if self._colspan == 1 else [""] * self._colspan)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self.header_rows[-1] += self._in_head
            self._row = None
        elif tag == "thead":
            self._in_head = False
        elif tag == "table" and self._depth:
            self._depth -= 1

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def html_table_parts(markup: str) -> list[tuple[list[list[str]], list[list[str]]]]:
    """Every ``<table>`` in ``markup`` as (header rows, body rows), each a list of cell texts."""
    parser = _TableParser()
    parser.feed(markup)
    return [(rows[:head], rows[head:]) for rows, head in zip(parser.tables, parser.header_rows)]


def index_label_rows(header: list[list[str]]) -> list[list[str]]:
    """Header rows that only label the index (a name in the first cell, the rest empty): pandas'
    extra row for a named index."""
    return [row for row in header if len(row) > 1 and row[0] and not any(row[1:])]


def number_format(text: str) -> str | None:
    """A cell's number format: "integer", "N decimals", "scientific, N decimals"; "" for a text
    every format shares (blank, 0, inf); None for a cell that is not a number."""
    text = text.strip()
    if text in ("", "0", "inf", "-inf"):
        return ""
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+|-?\d+", text):
        return "integer"
    if match := re.fullmatch(r"-?(\d{1,3}(,\d{3})+|\d+)\.(\d+)", text):
        return f"{len(match.group(3))} decimals"
    if match := re.fullmatch(r"-?\d\.(\d+)e[+-]\d+", text):
        return f"scientific, {len(match.group(1))} decimals"
    return None


def mixed_format_columns(body: list[list[str]]) -> dict[int, set[str]]:
    """Columns of a table's body rows whose cells are all numbers written in more than one
    format."""
    mixed = {}
    for column in range(max((len(row) for row in body), default=0)):
        formats = [number_format(row[column]) for row in body if column < len(row)]
        if formats and None not in formats and len(set(formats) - {""}) > 1:
            mixed[column] = set(formats) - {""}
    return mixed
