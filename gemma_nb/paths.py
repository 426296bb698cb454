"""Where things live: the repo, the bundled checkpoint, and a target's output folder.

Notebooks never build paths themselves. The runner points ``GEMMA_NB_OUTPUT_DIR`` at a
temporary folder (moved into ``outputs/<target>/`` only when every notebook succeeded), and
``make test`` points it at a scratch folder so nbval never rewrites the committed reference run.
Without that variable (a notebook opened from ``notebooks/`` in JupyterLab, a script) outputs go
to ``outputs/interactive/<target>/`` (git-ignored): trying a parameter by hand never changes the
reference run in ``outputs/cpu/``.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parent
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
OUTPUTS_DIR = REPO_ROOT / "outputs"
OUTPUT_DIR_ENV = "GEMMA_NB_OUTPUT_DIR"
INTERACTIVE_DIR = OUTPUTS_DIR / "interactive"


def output_dir(target: str) -> Path:
    """The folder a notebook run for ``target`` writes into (created if missing).

    ``GEMMA_NB_OUTPUT_DIR`` when set (the runner, ``make test``), else the scratch folder
    ``outputs/interactive/<target>/``; never the committed ``outputs/<target>/`` directly.
    """
    from gemma_nb.targets import check_target_name

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


def artifacts_dir(target: str) -> Path:
    """Large files a later notebook reads (exported programs, weights). Not committed."""
    return _sub(target, "artifacts")


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
