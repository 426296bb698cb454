"""The reader's page: cell formatting, the table-width estimate, paths and file modes of outputs."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import page_width
import pandas as pd
import pytest

from gemma_nb import display, paths, plots
from gemma_nb.metrics import save_metrics


def test_cut_at_eos_keeps_the_answer_before_the_first_marker():
    assert display.cut_at_eos("Paris . <eos><eos><eos>") == "Paris ."
    assert display.cut_at_eos("no marker ") == "no marker "
    assert display.cut_at_eos("<eos>tail") == ""
    assert display.format_cell("Tirana . <eos> <eos>") == "Tirana ."


@pytest.mark.parametrize(
    "value, shown",
    [
        (16461040.3, "16,461,040"),
        (25233141760.0, "25,233,141,760"),
        (2.0, "2"),
        (0.0, "0"),
        (53.0660, "53.07"),
        (0.99874, "0.9987"),
        (0.000116604, "0.0001166"),
        (3.2e-9, "3.200e-09"),
        (-0.651, "-0.651"),
        (float("nan"), ""),
        (1234.56, "1,235"),
    ],
)
def test_format_float(value, shown):
    assert display.format_float(value) == shown


def test_tidy_shows_words_and_blanks():
    frame = pd.DataFrame(
        {
            "ok": [True, False],
            "claim": [None, "x<eos><eos>"],
            "v": [np.nan, 1.5],
            "n": [262144, 7],
            "said": ["true", "False"],
        }
    )
    shown = display.tidy(frame)
    assert shown["ok"].tolist() == ["yes", "no"]
    assert shown["said"].tolist() == ["yes", "no"]
    assert shown["claim"].tolist() == ["", "x"]
    assert shown["v"].tolist() == ["", "1.5"]
    assert shown["n"].tolist() == ["262,144", "7"]


def test_table_width_estimate_counts_characters_and_wraps_text():
    # one column: widest cell 10 characters -> 10 x 7 px + 12 px padding
    assert (
        page_width.table_width_px([["header"], ["0123456789"]])
        == 10 * display.CHAR_WIDTH_PX + page_width.CELL_PADDING_PX
    )
    sentence = "a " * 100  # 200 characters with spaces: wraps at WRAP_CHARS
    assert page_width.cell_width_chars(sentence) == page_width.WRAP_CHARS
    assert page_width.cell_width_chars("x" * 60 + " y") == 60  # a long word cannot wrap
    wide = pd.DataFrame([[1.0] * 12], columns=[f"a_long_column_name_{i}" for i in range(12)])
    for frame, fits in ((wide, False), (wide.T, True)):
        header, body = page_width.html_table_parts(display._html(frame))[0]
        assert (page_width.table_width_px(header + body) < display.PAGE_WIDTH_PX) == fits


def test_html_table_parts_reads_what_the_estimate_needs():
    frame = pd.DataFrame({"claim": ["HYPOTHESIS: a long label"], "value": [1.0]})
    assert page_width.html_table_parts(display._html(frame)) == [
        ([["claim", "value"]], [["HYPOTHESIS: a long label", "1"]])
    ]


def test_subplots_refuses_a_figure_wider_than_the_page():
    with pytest.raises(AssertionError, match=r"figsize width 17 in is wider than the page"):
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


def test_outputs_are_found_from_the_working_directory_not_the_installed_package(tmp_path):
    """A non-editable install must not write next to site-packages: the project is the working
    directory's."""
    (tmp_path / "repo" / "notebooks").mkdir(parents=True)
    (tmp_path / "repo" / "pyproject.toml").write_text("")
    assert paths.find_project_root(tmp_path / "repo" / "notebooks") == (tmp_path / "repo").resolve()
    (tmp_path / "plain").mkdir()
    assert paths.find_project_root(tmp_path / "plain") == (tmp_path / "plain").resolve()
    env = {k: v for k, v in os.environ.items() if k != paths.OUTPUT_DIR_ENV}
    done = subprocess.run(
        [sys.executable, "-c", "from gemma_nb import paths; print(paths.output_dir('cpu'))"],
        cwd=tmp_path / "repo" / "notebooks",
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert (
        Path(done.stdout.strip())
        == (tmp_path / "repo" / "outputs" / "interactive" / "cpu").resolve()
    )


@pytest.mark.parametrize(
    "values, shown",
    [
        ([11.313708305358887, 11.3125], ["11.314", "11.312"]),  # different values never look alike
        # one count of decimals; zero is 0
        ([26.74, 15.35, 9.964, 0.0], ["26.740", "15.350", "9.964", "0"]),
        ([90.508, 0.043, 0.002], ["90.508", "0.043", "0.002"]),  # rounded to 3 decimals: shown so
        # unrounded, orders apart
        ([4.8e-05, 1.8e-07, 0.0123456789], ["4.80e-05", "1.80e-07", "1.23e-02"]),
        ([262144.0, 2816.0], ["262,144", "2,816"]),  # integral: separators for the column
        ([3.0, float("nan")], ["3", ""]),
    ],
)
def test_column_formatter_gives_a_column_one_format(values, shown):
    formatter = display.column_formatter(values)
    assert [formatter(v) for v in values] == shown
    assert len({page_width.number_format(s) for s in shown} - {""}) == 1


def test_number_format_reads_what_a_cell_shows():
    assert page_width.number_format("25,233,141,760") == "integer"
    assert page_width.number_format("0.0484") == "4 decimals"
    assert page_width.number_format("-1,234.50") == "2 decimals"
    assert page_width.number_format("4.80e-05") == "scientific, 2 decimals"
    assert page_width.number_format("0") == page_width.number_format("") == ""
    assert page_width.number_format("yes") is None and page_width.number_format("45.6 GB") is None
    body = [["a", "0.25", "1"], ["b", "4.000e-06", "2"], ["c", "0.03125", "x"]]
    assert page_width.mixed_format_columns(body) == {
        1: {"2 decimals", "scientific, 3 decimals", "5 decimals"}
    }


def test_column_formats_put_the_index_name_in_the_corner_and_hide_a_default_index():
    named = pd.DataFrame(
        {"gb": [22.84, 0.022]}, index=pd.Index(["experts", "router"], name="group")
    )
    header, body = page_width.html_table_parts(display._html(named))[0]
    assert header == [["group", "gb"]] and body == [["experts", "22.840"], ["router", "0.022"]]
    assert not page_width.index_label_rows(header)
    plain = pd.DataFrame({"scheme": ["bf16", "int8"], "kl": [0.0484, 0.0002]})
    header, body = page_width.html_table_parts(display._html(plain))[0]
    assert header == [["scheme", "kl"]] and body == [["bf16", "0.0484"], ["int8", "0.0002"]]


def test_header_cells_count_bold_in_the_width_estimate():
    rows = [["a_long_column_name"], ["1"]]
    assert page_width.table_width_px(rows, header_rows=1) > page_width.table_width_px(rows)
    assert (
        page_width.table_width_px(rows, header_rows=1)
        == 18 * page_width.HEADER_CHAR_WIDTH_PX + page_width.CELL_PADDING_PX
    )


def test_scientific_and_headline_table():
    assert display.scientific(pd.Series([5.3e-06, 0.0, float("nan"), 2.755])).tolist() == [
        "5.3e-06",
        "0",
        "",
        "2.8e+00",
    ]
    from gemma_nb.metrics import headline

    table = display.headline_table(
        [
            headline("total parameters", 25.233, "B", claim="total_params_b"),
            headline("bit-exact", True),
            headline("squeeze answers", "474 of 474"),
        ]
    )
    assert table.to_dict(orient="records") == [
        {"figure": "total parameters", "value": "25.23 B", "claimed": "25.2 B"},
        {"figure": "bit-exact", "value": "yes", "claimed": ""},
        {"figure": "squeeze answers", "value": "474 of 474", "claimed": ""},
    ]


def test_headline_rows_with_a_target_show_it_and_whether_it_was_met():
    from gemma_nb.metrics import headline

    rows = [
        headline("sparse vs dense", 13.7, "x", at_least=12.0),
        headline("step / floor", 2.54, "x", at_most=1.5),
        headline("bit-exact", True),
    ]
    table = display.headline_table(rows)
    assert table.drop(columns="claimed").to_dict(orient="records") == [
        {"figure": "sparse vs dense", "value": "13.7x", "target": "at least 12x", "met": "met"},
        {"figure": "step / floor", "value": "2.54x", "target": "at most 1.5x", "met": "missed"},
        {"figure": "bit-exact", "value": "yes", "target": "", "met": ""},
    ]
    assert table["claimed"].eq("").all()
    assert [row["met"] for row in rows[:2]] == [True, False] and "met" not in rows[2]


def test_collisions_name_what_overlaps():
    import matplotlib
    import matplotlib.pyplot

    matplotlib.use("Agg")
    fig, ax = plots.subplots(figsize=(6, 4))
    ax.bar([0, 1], [15.3, 10.0])
    ax.annotate("15.3", xy=(0, 15.3), xytext=(0, 2), textcoords="offset points", ha="center")
    plots.reference_line(ax, 16.0, "16 GB per core")
    assert plots.collisions(fig) == ["a line crosses text '15.3'"]
    fig, ax = plots.subplots(figsize=(6, 4))
    ax.bar([0, 1], [10.0, 9.0], label="bars")
    ax.set_ylim(0, 20)
    ax.legend(loc="lower left")
    assert plots.collisions(fig) == ["the legend covers a bar"]
    ax.get_legend().remove()
    ax.set_xticks([0, 1], ["a rather long tick label", "another long tick label"], rotation=30)
    assert plots.collisions(fig) == []  # rotated labels are checked as the rotated boxes they are
    # no constrained layout to make room for it
    fig, ax = matplotlib.pyplot.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="a line")
    ax.legend(loc="upper left", bbox_to_anchor=(1.2, 1.0))
    assert plots.collisions(fig) == ["the legend reaches past the figure's edge (its frame is cut)"]
    # handles passed without their labels: swatches a reader cannot tell apart
    fig, ax = plots.subplots(figsize=(6, 3))
    bars = [ax.bar([i], [1.0], label=name)[0] for i, name in enumerate(("experts", "lm_head"))]
    ax.legend(handles=[*bars, matplotlib.lines.Line2D([], [])], loc="upper left")
    ax.set_ylim(0, 4)
    assert plots.collisions(fig) == ["legend entry 3 has no label (pass labels to legend())"]
    matplotlib.pyplot.close("all")


def test_label_points_finds_free_places():
    import matplotlib

    matplotlib.use("Agg")
    fig, ax = plots.subplots(figsize=(5, 4))
    points = [
        (1.0, 1.0, "int8_experts"),
        (1.05, 1.0, "int8_experts_shared_mlp"),
        (1.1, 1.0, "int8_squeeze"),
    ]
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    ax.set_xlim(0.5, 1.6)
    plots.label_points(ax, points)
    assert plots.collisions(fig) == []
    assert [t.get_text() for t in ax.texts] == [p[2] for p in points]


def test_show_figure_needs_alt_text_and_refuses_collisions(monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.setenv(paths.OUTPUT_DIR_ENV, str(tmp_path))
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda fig, metadata: shown.append(metadata))
    fig, ax = plots.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1])
    with pytest.raises(ValueError, match="needs alt text"):
        plots.show_figure(fig, "cpu", "01_line", alt=" ")
    written = plots.show_figure(fig, "cpu", "01_line", alt="A rising line.")
    assert shown == [{"image/png": {"alt": "A rising line."}}] and written["png"].exists()
    fig, ax = plots.subplots(figsize=(4, 3))
    ax.set_title("one title")
    ax.text(0.5, 1.0, "one title", transform=ax.transAxes, ha="center", va="bottom")
    monkeypatch.delenv("GEMMA_NB_TIMING", raising=False)
    with pytest.raises(
        ValueError, match="figure '01_clash': texts 'one title' and 'one title' overlap"
    ):
        plots.show_figure(fig, "cpu", "01_clash", alt="Two titles.")
    # a smoke run (nbval's) saves and shows it: its timings move with the cpu and no one reads them
    fig, ax = plots.subplots(figsize=(4, 3))
    ax.set_title("one title")
    ax.text(0.5, 1.0, "one title", transform=ax.transAxes, ha="center", va="bottom")
    monkeypatch.setenv("GEMMA_NB_TIMING", "smoke")
    assert plots.show_figure(fig, "cpu", "01_clash", alt="Two titles.")["png"].exists()
