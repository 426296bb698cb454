"""Where things live: the repo (the checkout holding the package, whatever the working directory),
its outputs (``outputs/``, or ``GEMMA_NB_OUTPUTS``), and a target's output folders: under
``GEMMA_NB_OUTPUT_DIR`` (the runner), else the git-ignored ``outputs/interactive/<target>/``, never
the reference run."""

import os
import shutil
from pathlib import Path

from gemma_nb.targets import check_target_name


def find_project_root(package: Path = Path(__file__).resolve().parent) -> Path:
    """The checkout holding ``package`` (pyproject.toml beside it), from any working directory; for
    an install without one (a wheel), the working directory: never site-packages."""
    checkout = package.parent
    return checkout if (checkout / "pyproject.toml").is_file() else Path.cwd().resolve()


REPO_ROOT = find_project_root()
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
OUTPUTS_DIR = Path(os.environ.get("GEMMA_NB_OUTPUTS") or REPO_ROOT / "outputs").absolute()
OUTPUT_DIR_ENV = "GEMMA_NB_OUTPUT_DIR"
INTERACTIVE_DIR = OUTPUTS_DIR / "interactive"
ARTIFACTS = "artifacts"


def output_dir(target: str) -> Path:
    """The folder a notebook run for ``target`` writes into (created if missing)."""
    check_target_name(target)
    override = os.environ.get(OUTPUT_DIR_ENV)
    folder = Path(override) if override else INTERACTIVE_DIR / target
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def output_subdir(target: str, name: str) -> Path:
    folder = output_dir(target) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def artifacts_dir(target: str) -> Path:
    """Large files a later notebook reads (not committed); write one with :func:`fresh_dir` (a
    partial run hard-links them)."""
    return output_subdir(target, ARTIFACTS)


def fresh_dir(folder: Path | str) -> Path:
    """``folder``, removed and created again, so no file hard-linked from a previous run is written
    through."""
    folder = Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def display_path(path: Path | str) -> str:
    """A path relative to the output folder or repo, never absolute (absolute paths differ per
    machine)."""
    path = Path(path).resolve()
    override = os.environ.get(OUTPUT_DIR_ENV)
    roots = [(Path(override).resolve(), "<outputs>")] if override else []
    roots += [(OUTPUTS_DIR.resolve(), "outputs"), (REPO_ROOT.resolve(), ".")]
    for root, label in roots:
        if path.is_relative_to(root):
            rel = path.relative_to(root)
            return f"{label}/{rel.as_posix()}" if str(rel) != "." else label
    return path.name
