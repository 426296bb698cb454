"""How an executed notebook looks to its reader: ``setup_page()`` (every notebook's first code cell)
makes tables fit a ~1,000 px JupyterLab page (tests/page_width.py estimates their width)."""

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pandas as pd
from IPython import get_ipython

from gemma_nb import plots
from gemma_nb.metrics import target_cells
from gemma_nb.story import get_claim, with_unit

PAGE_WIDTH_PX = 1000
# JupyterLab's default theme: 12 px sans-serif cells, 0.5 em padding either side; a digit's advance
# in Helvetica/Arial at 12 px (6.7 px) rounded up, so the estimate errs wide. Spaced text wraps.
CHAR_WIDTH_PX = 7.0
EOS = "<eos>"
MAX_ROWS = 120
SIGNIFICANT_DIGITS = 4
MAX_DECIMALS = 8
# Values written exactly with at most this many decimals were rounded: shown so. Other columns are
# shown in scientific notation if they hold a smaller non-zero magnitude than SCIENTIFIC_BELOW, or
# their largest magnitude is SCIENTIFIC_SPAN times their smallest (below 1).
ROUNDED_DECIMALS = 6
SCIENTIFIC_BELOW = 1e-4
SCIENTIFIC_SPAN = 1e4


def cut_at_eos(text: str, eos: str = EOS) -> str:
    """``text`` before its first ``eos``, as a reader reads an answer: "Paris . <eos>..." ->
    "Paris ."."""
    return text.split(eos, 1)[0].rstrip() if eos in text else text


def format_float(value: float) -> str:
    """About four significant digits, thousands separated, scientific only when tiny; NaN as a
    blank."""
    if (special := _special(value)) is not None:
        return special
    value = float(value)
    magnitude = abs(value)
    if magnitude >= 1e4 or value == round(value):
        return f"{value:,.0f}"
    if magnitude < 1e-4:
        return f"{value:.3e}"
    text = f"{value:,.{max(0, 3 - math.floor(math.log10(magnitude)))}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_cell(value: Any) -> str:
    """One cell as shown: bools as yes/no, missing as blank, large integers separated, text cut at
    ``<eos>``."""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        return format_float(float(value))
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}" if abs(int(value)) >= 10_000 else str(int(value))
    # a bool that went through str() or JSON
    if isinstance(value, str) and value in ("True", "true", "False", "false"):
        return "yes" if value.lower() == "true" else "no"
    with contextlib.suppress(TypeError, ValueError):  # pd.isna of an array is no truth value
        if pd.isna(value):
            return ""
    return cut_at_eos(str(value))


def _decimals_for(values: list[float], decimals: int, limit: int, render) -> int:
    """``decimals``, raised (up to ``limit``) until different values no longer render alike."""
    while decimals < limit and len({render(v, decimals) for v in values}) < len(set(values)):
        decimals += 1
    return decimals


def column_formatter(values) -> Callable[[Any], str]:
    """One number format for a column: whole numbers if integral, else one count of decimals
    (``SIGNIFICANT_DIGITS`` of the smallest magnitude, at most the values', more where two would
    look alike), or scientific for unrounded tiny or wide ones."""
    finite = [float(v) for v in values if not _missing(v) and math.isfinite(float(v))]
    magnitudes = [abs(v) for v in finite if v != 0.0]
    if not magnitudes or all(v.is_integer() for v in finite):
        separators = any(abs(v) >= 1e4 for v in finite)
        return _with_specials(lambda v: f"{v:,.0f}" if separators else f"{v:.0f}")
    low, high = min(magnitudes), max(magnitudes)
    # the fewest decimals that write every value as it is, e.g. after round(3)
    exact = next(
        (d for d in range(MAX_DECIMALS + 1) if all(round(v, d) == v for v in finite)), MAX_DECIMALS
    )
    wanted = max(0, SIGNIFICANT_DIGITS - 1 - math.floor(math.log10(low)))
    if exact > ROUNDED_DECIMALS and (
        low < SCIENTIFIC_BELOW or (low < 1 and high / low >= SCIENTIFIC_SPAN)
    ):
        decimals = _decimals_for(
            finite, SIGNIFICANT_DIGITS - 2, MAX_DECIMALS, lambda v, d: f"{v:.{d}e}"
        )
        return _with_specials(lambda v: f"{v:.{decimals}e}")
    decimals = _decimals_for(finite, min(wanted, exact), exact, lambda v, d: f"{v:,.{d}f}")
    return _with_specials(lambda v: f"{v:,.{decimals}f}")


def _missing(value) -> bool:
    try:
        return value is None or bool(value != value)  # NaN and pandas' NA
    except (TypeError, ValueError):
        return True


def _with_specials(write: Callable[[float], str]) -> Callable[[Any], str]:
    return lambda value: write(float(value)) if _special(value) is None else _special(value)


def _special(value) -> str | None:
    """The text of a value every format writes the same way (blank, 0, inf), else None."""
    if _missing(value):
        return ""
    value = float(value)
    return "0" if value == 0.0 else ("inf" if value > 0 else "-inf") if math.isinf(value) else None


def _format_column(column) -> list[str]:
    numbers = pd.api.types.is_numeric_dtype(column.dtype) and not pd.api.types.is_bool_dtype(
        column.dtype
    )
    # an object column of numbers (a transposed table of dicts) gets one format like a float column
    kinds = [
        isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
        for v in column
    ]
    numbers = numbers or all(k or _missing(v) for k, v in zip(kinds, column)) and any(kinds)
    write = column_formatter(column.tolist()) if numbers else format_cell
    return [write(v) for v in column]


def tidy(frame):
    """``frame`` as strings: one format per numeric column, the others per cell."""
    shown = pd.DataFrame(
        {i: _format_column(frame.iloc[:, i]) for i in range(frame.shape[1])},
        index=_tidy_index(frame.index),
    )
    shown.columns = _tidy_index(frame.columns)
    return shown


def _tidy_index(index):
    if isinstance(index, pd.MultiIndex):
        return pd.MultiIndex.from_tuples(
            [tuple(format_cell(v) for v in labels) for labels in index], names=index.names
        )
    if isinstance(index, pd.RangeIndex):
        return index
    return pd.Index([format_cell(v) for v in index], name=index.name)


def _shown(frame):
    """``frame`` (a DataFrame or Series) as the page shows it, and whether its index is shown."""
    shown = tidy(frame.to_frame() if isinstance(frame, pd.Series) else frame)
    if isinstance(frame.index, pd.RangeIndex) and frame.index.name is None:
        return shown, False
    if shown.index.nlevels > 1 or shown.columns.nlevels > 1:
        return shown.reset_index(), False
    if shown.index.name is not None:  # the name labels the corner cell, not a row of its own
        shown.columns.name, shown.index.name = shown.index.name, None
    return shown, True


def _html(frame) -> str:
    shown, index = _shown(frame)
    return shown.to_html(max_rows=MAX_ROWS, notebook=True, index=index)


def _plain(frame, printer, cycle) -> None:
    shown, index = _shown(frame)
    printer.text(shown.to_string(max_rows=MAX_ROWS, index=index))


def setup_page() -> None:
    """Pandas options, IPython table formatters (one number format per column, index names in the
    header's corner, no default index) and the plot theme; idempotent."""
    for option, value in (
        ("max_colwidth", None),
        ("max_columns", None),
        ("max_rows", MAX_ROWS),
        ("width", int(PAGE_WIDTH_PX / CHAR_WIDTH_PX)),
        ("float_format", format_float),
    ):
        pd.set_option(f"display.{option}", value)
    shell = get_ipython()
    if shell is None:
        return
    formatters = shell.display_formatter.formatters
    for kind in (pd.DataFrame, pd.Series):
        formatters["text/html"].for_type(kind, _html)
        formatters["text/plain"].for_type(kind, _plain)
    plots.set_theme()


def headline_table(rows: Iterable[dict]):
    """A notebook's headline rows (``metrics.headline``): figure, value with unit, the claim as its
    source wrote it (or blank), and where a row has a target, the target and whether it was met."""

    def value(row) -> str:
        return with_unit(
            row["value"] if isinstance(row["value"], str) else format_cell(row["value"]),
            row.get("unit", ""),
        )

    table = pd.DataFrame(
        [
            {
                "figure": row["name"],
                "value": value(row),
                **dict(zip(("target", "met"), target_cells(row))),
                "claimed": get_claim(row["claim"]).written() if "claim" in row else "",
            }
            for row in rows
        ]
    )
    return table if table["target"].any() else table.drop(columns=["target", "met"])


def scientific(values, digits: int = 2):
    """``values`` (a Series) as text in scientific notation with ``digits`` significant digits."""
    return values.map(_with_specials(lambda v: f"{v:.{digits - 1}e}"))
