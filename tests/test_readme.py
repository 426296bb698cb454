"""The README's notebook → module table names exactly the modules each notebook imports."""

from __future__ import annotations

import ast
import re

import nbformat

from gemma_nb.paths import NOTEBOOKS_DIR, REPO_ROOT

# Imported by every notebook for its page, target and metrics; the README names them once, under the
# table.
PLUMBING = {"display", "metrics", "paths", "plots", "story", "targets"}


def notebook_modules(path) -> set[str]:
    """The gemma_nb modules a notebook's code cells import, named relative to the package."""
    found = set()
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join(
            line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))
        )
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gemma_nb"):
                base = node.module.removeprefix("gemma_nb").lstrip(".")
                for alias in node.names:
                    module = f"{base}.{alias.name}".lstrip(".")
                    found.add(module if _is_module(module) else base)
    return found - PLUMBING


def _is_module(name: str) -> bool:
    path = REPO_ROOT / "gemma_nb" / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def readme_table() -> dict[str, set[str]]:
    rows = {}
    for line in (REPO_ROOT / "README.md").read_text().splitlines():
        if match := re.match(
            r"\| \[(\d\d) [^]]+\]\(outputs/cpu/(\w+)\.ipynb\) \|.*\| (.+) \|$", line
        ):
            rows[match[2]] = set(re.findall(r"`([\w.]+)`", match[3]))
    return rows


def test_the_readme_names_each_notebooks_modules():
    table = readme_table()
    notebooks = sorted(p.stem for p in NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert sorted(table) == notebooks
    for name in notebooks:
        assert table[name] == notebook_modules(NOTEBOOKS_DIR / f"{name}.ipynb"), name


def test_the_plumbing_modules_exist():
    assert all(_is_module(name) for name in PLUMBING)
