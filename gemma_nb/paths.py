"""Where things live: the repo, the bundled checkpoint, and a target's output folder.

Notebooks never build paths themselves. The runner points ``GEMMA_NB_OUTPUT_DIR`` at a
temporary folder (moved into ``outputs/<target>/`` only when every notebook succeeded), and
``make test`` points it at a scratch folder so nbval never rewrites the committed reference run.
Without that variable (a notebook opened from ``notebooks/`` in JupyterLab, a script) outputs go
to ``outputs/interactive/<target>/`` (git-ignored): trying a parameter by hand never changes the
reference run in ``outputs/cpu/``.

The project folder (``REPO_ROOT``: where ``notebooks/``, ``outputs/``, ``docs/`` and ``envs/`` are)
is found from the working directory, never from where the package is installed: the nearest folder
at or above it holding a ``pyproject.toml`` or a ``.git``, else the working directory itself. So a
non-editable install (the package in site-packages) still writes under the repo it is run from.
"""

from __future__ import annotations

import os
from pathlib import Path

from gemma_nb.targets import check_target_name

PROJECT_MARKERS = ("pyproject.toml", ".git")


def find_project_root(start: Path | str | None = None) -> Path:
    """The nearest folder at or above ``start`` (default: the working directory) holding one of
    ``PROJECT_MARKERS``; ``start`` itself if there is none."""
    start = Path.cwd() if start is None else Path(start)
    start = start.resolve()
    for folder in (start, *start.parents):
        if any((folder / marker).exists() for marker in PROJECT_MARKERS):
            return folder
    return start


REPO_ROOT = find_project_root()
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
OUTPUTS_DIR = REPO_ROOT / "outputs"
OUTPUT_DIR_ENV = "GEMMA_NB_OUTPUT_DIR"
INTERACTIVE_DIR = OUTPUTS_DIR / "interactive"


def output_dir(target: str) -> Path:
    """The folder a notebook run for ``target`` writes into (created if missing).

    ``GEMMA_NB_OUTPUT_DIR`` when set (the runner, ``make test``), else the scratch folder
    ``outputs/interactive/<target>/``; never the committed ``outputs/<target>/`` directly.
    """
    check_target_name(target)
    override = os.environ.get(OUTPUT_DIR_ENV)
    folder = Path(override) if override else INTERACTIVE_DIR / target
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _sub(target: str, name: str) -> Path:
    folder = output_dir(target) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def metrics_dir(target: str) -> Path:
    return _sub(target, "metrics")


def figures_dir(target: str) -> Path:
    return _sub(target, "figures")


ARTIFACTS = "artifacts"


def artifacts_dir(target: str) -> Path:
    """Large files a later notebook reads (exported programs, weights). Not committed.

    A partial run (``run --only``) hard-links them from the previous run: write an artifact folder
    with :func:`fresh_dir`, never into an existing file.
    """
    return _sub(target, ARTIFACTS)


def fresh_dir(folder: Path | str) -> Path:
    """``folder``, emptied (removed and created again): what an artifact writer starts from, so that
    no file hard-linked from a previous run is written through."""
    import shutil

    folder = Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def display_path(path: Path | str) -> str:
    """A path as a reader should see it: relative to the output folder or repo, never absolute.

    Absolute paths differ per machine and would make nbval outputs (and logs) non-reproducible.
    """
    path = Path(path).resolve()
    roots = []
    override = os.environ.get(OUTPUT_DIR_ENV)
    if override:
        roots.append((Path(override).resolve(), "<outputs>"))
    roots += [(OUTPUTS_DIR.resolve(), "outputs"), (REPO_ROOT.resolve(), ".")]
    for root, label in roots:
        try:
            rel = path.relative_to(root)
        except ValueError:
            continue
        return f"{label}/{rel.as_posix()}" if str(rel) != "." else label
    return path.name
