"""One way to draw and save every figure: seaborn theme, PNG + SVG, byte-identical on a re-run."""

import functools
import itertools
import math
from pathlib import Path

import IPython.display
import matplotlib
import matplotlib.collections
import matplotlib.text

matplotlib.rcParams["svg.hashsalt"] = "gemma-nb"

import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from gemma_nb.bench import smoke_timing  # noqa: E402
from gemma_nb.paths import output_subdir  # noqa: E402

# A figure is shown at 100 dpi inline: 10 inches fill the ~1,000 px of a JupyterLab or GitHub page.
# Wider, the browser scales it down and its 10 pt labels become unreadable.
MAX_WIDTH_IN = 10.0
# Where ``label_points`` tries a label, in order: offsets in points from its point, and the
# alignment.
LABEL_OFFSETS = [
    (5, 3, "left", "bottom"),
    (5, -3, "left", "top"),
    (-5, 3, "right", "bottom"),
    (-5, -3, "right", "top"),
    (0, 7, "center", "bottom"),
    (0, -7, "center", "top"),
] + [
    (dx * side, dy * up, {1: "left", -1: "right", 0: "center"}[side], "bottom" if up > 0 else "top")
    for dy in (14, 26, 38)
    for dx in (4, 0)
    for up in (1, -1)
    for side in (1, -1, 0)
    if dx or side
]


def set_theme() -> None:
    sns.set_theme(style="whitegrid", context="notebook", palette="colorblind")
    # the inline backend saves with bbox_inches="tight": no extra margin, so 10 in stay 1,000 px
    matplotlib.rcParams.update(
        {"svg.hashsalt": "gemma-nb", "figure.dpi": 100, "savefig.pad_inches": 0.0}
    )


def subplots(*args, **kwargs):
    """``plt.subplots`` with the project theme applied first; ``figsize`` at most 10 inches wide."""
    set_theme()
    kwargs.setdefault("layout", "constrained")
    width = kwargs.get("figsize", matplotlib.rcParams["figure.figsize"])[0]
    assert width <= MAX_WIDTH_IN, (
        f"figsize width {width} in is wider than the page ({MAX_WIDTH_IN:g} in)"
    )
    return plt.subplots(*args, **kwargs)


def reference_line(ax, value: float, label: str, axis: str = "y", **kwargs) -> None:
    """A dashed line at a figure the story reported (or a hardware limit), labelled on the plot."""
    style = {"color": "0.25", "linestyle": "--", "linewidth": 1.2, **kwargs}
    assert axis in ("x", "y"), axis
    if axis == "y":
        ax.axhline(value, **style)
        place = {
            "xy": (1.0, value),
            "xycoords": ("axes fraction", "data"),
            "xytext": (-4, 3),
            "ha": "right",
            "va": "bottom",
        }
    else:
        ax.axvline(value, **style)
        place = {
            "xy": (value, 1.0),
            "xycoords": ("data", "axes fraction"),
            "xytext": (3, -4),
            "ha": "left",
            "va": "top",
            "rotation": 90,
        }
    ax.annotate(label, textcoords="offset points", fontsize=9, color=style["color"], **place)


def _tick_labels(ax):
    """The tick labels ``ax`` draws: those of ticks inside the view limits."""
    drawn, every = [], []
    for axis in (ax.xaxis, ax.yaxis):
        low, high = sorted(axis.get_view_interval())
        span = (high - low) or 1.0
        for tick in axis.get_major_ticks() + axis.get_minor_ticks():
            labels = (tick.label1, tick.label2)
            every += labels
            if low - 1e-9 * span <= tick.get_loc() <= high + 1e-9 * span:
                drawn += [label for label in labels if label.get_visible()]
    return drawn, every


def _texts(fig, renderer):
    """Every drawn, non-empty text of ``fig`` with its box on the canvas (not a legend's: it is one
    box)."""
    skip = {id(t) for legend in _legends(fig) for t in [*legend.get_texts(), legend.get_title()]}
    ticks = [_tick_labels(ax) for ax in fig.axes]
    skip |= {id(t) for _, every in ticks for t in every}
    candidates = [t for drawn, _ in ticks for t in drawn]
    candidates += [
        t for t in fig.findobj(matplotlib.text.Text) if id(t) not in skip and t.get_visible()
    ]
    boxes = [
        (text, text.get_window_extent(renderer)) for text in candidates if text.get_text().strip()
    ]
    return [
        (text, box, _corners(text, box, renderer))
        for text, box in boxes
        if box.width > 0 and box.height > 0
    ]


def _corners(text, box, renderer):
    """The four corners of ``text``'s rotated rectangle on the canvas, centred on ``box``, its
    axis-aligned box."""
    rotation = text.get_rotation()
    angle = math.radians(rotation)
    if abs(math.sin(angle)) < 1e-6 or abs(math.cos(angle)) < 1e-6:
        return [(box.x0, box.y0), (box.x1, box.y0), (box.x1, box.y1), (box.x0, box.y1)]
    text.set_rotation(0)
    flat = text.get_window_extent(renderer)
    text.set_rotation(rotation)
    cx, cy, c, s = (box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2, math.cos(angle), math.sin(angle)
    w, h = flat.width / 2, flat.height / 2
    return [
        (cx + x * c - y * s, cy + x * s + y * c) for x, y in ((-w, -h), (w, -h), (w, h), (-w, h))
    ]


def _shapes_overlap(first, second) -> bool:
    """Whether two convex polygons (lists of corners) overlap: no edge direction separates them."""
    for shape in (first, second):
        for (x0, y0), (x1, y1) in zip(shape, shape[1:] + shape[:1]):
            axis = (y0 - y1, x1 - x0)
            a = [axis[0] * x + axis[1] * y for x, y in first]
            b = [axis[0] * x + axis[1] * y for x, y in second]
            if max(a) <= min(b) or max(b) <= min(a):
                return False
    return True


def _legends(fig):
    legends = [ax.get_legend() for ax in fig.axes] + list(fig.legends)
    return [legend for legend in legends if legend is not None and legend.get_visible()]


def _label(text) -> str:
    return repr(text.get_text().strip()[:40])


def _lines_through(box, ax) -> list[str]:
    """The drawn lines of ``ax`` (data and reference lines, not the grid) that cross ``box``."""
    return [
        line.get_label() if not line.get_label().startswith("_") else "a line"
        for line in ax.get_lines()
        if line.get_visible()
        and len(line.get_xydata())
        and line.get_transform().transform_path(line.get_path()).intersects_bbox(box, filled=False)
    ]


def _points_inside(box, ax) -> int:
    return sum(
        sum(box.contains(x, y) for x, y in c.get_offset_transform().transform(c.get_offsets()))
        for c in ax.collections
        if isinstance(c, matplotlib.collections.PathCollection) and c.get_visible()
    )


def collisions(fig) -> list[str]:
    """What overlaps in ``fig`` once drawn, as short sentences: two texts (labels, titles,
    annotations, ticks); a text in the axes crossed by a line or covering a scatter point; a legend
    over a text, line, bar or point of its axes, or past the edge, or with an entry unlabelled."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = _texts(fig, renderer)
    found = [
        f"texts {_label(text)} and {_label(other)} overlap"
        for (text, box, shape), (other, other_box, other_shape) in itertools.combinations(texts, 2)
        if box.overlaps(other_box) and _shapes_overlap(shape, other_shape)
    ]
    for text, box, _ in texts:
        ax = text.axes
        if ax is None or any(text is label for label in _tick_labels(ax)[1]):
            continue
        found += [f"{name} crosses text {_label(text)}" for name in _lines_through(box, ax)]
        if points := _points_inside(box, ax):
            found.append(f"text {_label(text)} covers {points} point(s)")
    for legend in _legends(fig):
        found += [
            f"legend entry {index + 1} has no label (pass labels to legend())"
            for index, text in enumerate(legend.get_texts())
            if not text.get_text().strip()
        ]
        box = legend.get_window_extent(renderer)
        if not (fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)):
            found.append("the legend reaches past the figure's edge (its frame is cut)")
        found += [
            f"the legend covers text {_label(text)}"
            for text, text_box, _ in texts
            if box.overlaps(text_box)
        ]
        for ax in (
            [legend.axes] if legend.axes is not None and legend not in fig.legends else fig.axes
        ):
            found += [f"the legend covers {name}" for name in _lines_through(box, ax)]
            found += [
                "the legend covers a bar"
                for patch in ax.patches
                if patch.get_visible() and box.overlaps(patch.get_window_extent(renderer))
            ][:1]
            if points := _points_inside(box, ax):
                found.append(f"the legend covers {points} point(s)")
    return found


def show_figure(fig, target: str, name: str, alt: str) -> dict[str, Path]:
    """Instead of ``plt.show()``: refuse ``fig`` if labels collide or a legend entry has none, else
    save it as ``figures/<name>.png`` and ``.svg`` (``name`` starts with the notebook number:
    ``01_bytes_per_rank``), display it with ``alt`` text and close it. A smoke run
    (``GEMMA_NB_TIMING=smoke``, nbval's) draws timings no one reads and that move with the cpu:
    collisions pass there."""
    if not alt or not alt.strip():
        raise ValueError(f"figure {name!r} needs alt text: one sentence saying what it shows")
    assert name and "/" not in name and not name.endswith((".png", ".svg")), (
        f"figure name {name!r}: a bare stem"
    )
    overlaps = collisions(fig)
    if overlaps and not smoke_timing():
        plt.close(fig)
        raise ValueError(
            f"figure {name!r}: " + "; ".join(overlaps) + ". Move or shorten those labels."
        )
    folder = output_subdir(target, "figures")
    paths = {"png": folder / f"{name}.png", "svg": folder / f"{name}.svg"}
    fig.savefig(paths["png"], dpi=120, metadata={"Software": None})
    fig.savefig(paths["svg"], metadata={"Date": None, "Creator": None})
    IPython.display.display(fig, metadata={"image/png": {"alt": alt.strip()}})
    plt.close(fig)
    return paths


def label_points(ax, points, fontsize: float = 8) -> None:
    """Name each point ``(x, y, label)`` of ``ax`` at the first place of ``LABEL_OFFSETS`` inside
    the axes clear of labels, points, lines and the legend, else at the one with the fewest
    conflicts (which ``collisions`` then reports)."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    legend = ax.get_legend()
    blocked = [legend.get_window_extent(renderer)] if legend is not None else []
    annotate = functools.partial(ax.annotate, textcoords="offset points", fontsize=fontsize)
    for x, y, label in points:
        tried = []
        for dx, dy, ha, va in LABEL_OFFSETS:
            text = annotate(label, (x, y), xytext=(dx, dy), ha=ha, va=va)
            box = text.get_window_extent(renderer)
            text.remove()
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            conflicts = (
                (not inside)
                + sum(box.overlaps(other) for other in blocked)
                + len(_lines_through(box, ax))
            )
            tried.append((conflicts + _points_inside(box, ax), (dx, dy, ha, va)))
            if tried[-1][0] == 0:
                break
        dx, dy, ha, va = min(tried, key=lambda t: t[0])[1]
        text = annotate(label, (x, y), xytext=(dx, dy), ha=ha, va=va)
        blocked.append(text.get_window_extent(renderer))
