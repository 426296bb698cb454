"""One way to draw and save every figure: seaborn theme, PNG + SVG, no timestamps.

SVGs are written with ``metadata={'Date': None}`` and a fixed ``svg.hashsalt`` so re-running a
notebook gives byte-identical files (clean git diffs of ``outputs/cpu``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.rcParams["svg.hashsalt"] = "gemma-nb"

import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from gemma_nb.paths import figures_dir  # noqa: E402


def set_theme() -> None:
    sns.set_theme(style="whitegrid", context="notebook", palette="colorblind")
    matplotlib.rcParams["svg.hashsalt"] = "gemma-nb"
    matplotlib.rcParams["figure.dpi"] = 100
    # the inline backend saves with bbox_inches="tight": no extra margin, so 10 in stay 1,000 px
    matplotlib.rcParams["savefig.pad_inches"] = 0.0


# A figure is shown at 100 dpi inline: 10 inches fill the ~1,000 px of a JupyterLab or GitHub page.
# Wider, the browser scales it down and its 10 pt labels become unreadable.
MAX_WIDTH_IN = 10.0


def subplots(*args, **kwargs):
    """``plt.subplots`` with the project theme applied first; ``figsize`` at most 10 inches wide."""
    set_theme()
    kwargs.setdefault("layout", "constrained")
    width = kwargs.get("figsize", matplotlib.rcParams["figure.figsize"])[0]
    if width > MAX_WIDTH_IN:
        raise ValueError(f"figsize width {width} in is wider than the page ({MAX_WIDTH_IN:g} in = 1,000 px at "
                         "100 dpi); stack the panels in rows instead")
    return plt.subplots(*args, **kwargs)


def reference_line(ax, value: float, label: str, axis: str = "y", **kwargs) -> None:
    """A dashed line at a figure the story reported (or a hardware limit), labelled on the plot."""
    style = {"color": "0.25", "linestyle": "--", "linewidth": 1.2}
    style.update(kwargs)
    if axis == "y":
        ax.axhline(value, **style)
        ax.annotate(label, xy=(1.0, value), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                    textcoords="offset points", ha="right", va="bottom", fontsize=9, color=style["color"])
    elif axis == "x":
        ax.axvline(value, **style)
        ax.annotate(label, xy=(value, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -4),
                    textcoords="offset points", ha="left", va="top", fontsize=9, color=style["color"],
                    rotation=90)
    else:
        raise ValueError(f"axis {axis!r} is not 'x' or 'y'")


def save_figure(fig, target: str, name: str) -> dict[str, Path]:
    """Save ``fig`` as ``figures/<name>.png`` and ``.svg`` under the target's output folder.

    ``name`` starts with the notebook number (``01_bytes_per_rank``) so REPORT.md can group them.
    Returns the two paths.
    """
    if not name or "/" in name or name.endswith((".png", ".svg")):
        raise ValueError(f"figure name {name!r} must be a bare stem like '01_bytes_per_rank'")
    folder = figures_dir(target)
    paths = {"png": folder / f"{name}.png", "svg": folder / f"{name}.svg"}
    fig.savefig(paths["png"], dpi=120, metadata={"Software": None})
    fig.savefig(paths["svg"], metadata={"Date": None, "Creator": None})
    return paths
