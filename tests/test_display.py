"""The reader's page: cell formatting, the table-width estimate, paths and file modes of outputs."""

import os
import stat

import numpy as np
import pandas as pd
import pytest

from gemma_nb import display, paths, plots
from gemma_nb.metrics import save_metrics


def test_cut_at_eos_keeps_the_first_marker_only():
    assert display.cut_at_eos("Paris.<eos><eos><eos>") == "Paris.<eos>"
    assert display.cut_at_eos("no marker") == "no marker"
    assert display.cut_at_eos("<eos>tail") == "<eos>"


@pytest.mark.parametrize("value, shown", [
    (16461040.3, "16,461,040"), (25233141760.0, "25,233,141,760"), (2.0, "2"), (0.0, "0"),
    (53.0660, "53.07"), (0.99874, "0.9987"), (0.000116604, "0.0001166"), (3.2e-9, "3.200e-09"),
    (-0.651, "-0.651"), (float("nan"), ""), (1234.56, "1,235"),
])
def test_format_float(value, shown):
    assert display.format_float(value) == shown


def test_tidy_shows_words_and_blanks():
    frame = pd.DataFrame({"ok": [True, False], "claim": [None, "x<eos><eos>"], "v": [np.nan, 1.5],
                          "n": [262144, 7], "said": ["true", "False"]})
    shown = display.tidy(frame)
    assert shown["ok"].tolist() == ["yes", "no"]
    assert shown["said"].tolist() == ["yes", "no"]
    assert shown["claim"].tolist() == ["", "x<eos>"]
    assert shown["v"].tolist() == ["", "1.5"]
    assert shown["n"].tolist() == ["262,144", "7"]


def test_table_width_estimate_counts_characters_and_wraps_text():
    # one column: widest cell 10 characters -> 10 x 7 px + 12 px padding
    assert display.table_width_px([["header"], ["0123456789"]]) == 10 * display.CHAR_WIDTH_PX + display.CELL_PADDING_PX
    sentence = "a " * 100  # 200 characters with spaces: wraps at WRAP_CHARS
    assert display.cell_width_chars(sentence) == display.WRAP_CHARS
    assert display.cell_width_chars("x" * 60 + " y") == 60  # a long word cannot wrap
    wide = pd.DataFrame([[1.0] * 12], columns=[f"a_long_column_name_{i}" for i in range(12)])
    assert display.frame_width_px(wide) > display.PAGE_WIDTH_PX
    assert display.frame_width_px(wide.T) < display.PAGE_WIDTH_PX


def test_html_tables_reads_what_the_estimate_needs():
    frame = pd.DataFrame({"claim": ["HYPOTHESIS: a long label"], "value": [1.0]})
    tables = display.html_tables(display._html(frame))
    assert tables == [[["", "claim", "value"], ["0", "HYPOTHESIS: a long label", "1"]]]
    assert display.table_width_px(tables[0]) == display.frame_width_px(frame)


def test_subplots_refuses_a_figure_wider_than_the_page():
    with pytest.raises(ValueError, match=r"figsize width 17 in is wider than the page"):
        plots.subplots(1, 2, figsize=(17, 5))


def test_interactive_outputs_go_to_a_scratch_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(paths.OUTPUT_DIR_ENV, raising=False)
    monkeypatch.setattr(paths, "INTERACTIVE_DIR", tmp_path / "interactive")
    assert paths.output_dir("cpu") == tmp_path / "interactive" / "cpu"
    monkeypatch.setenv(paths.OUTPUT_DIR_ENV, str(tmp_path / "run"))
    assert paths.output_dir("cpu") == tmp_path / "run"


def test_metrics_are_readable_by_everyone(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.OUTPUT_DIR_ENV, str(tmp_path))
    path = save_metrics("cpu", "01_memory_arithmetic", {"x": 1.0})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
