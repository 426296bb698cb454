"""docs/inf2.md: exactly what ``python -m gemma_nb runbook`` writes now, every command real, linked from README."""

import re
import shlex

import pytest

from gemma_nb import runbook
from gemma_nb.__main__ import build_parser
from gemma_nb.hardware import INSTANCES
from gemma_nb.paths import REPO_ROOT
from gemma_nb.story import CLAIMS


def test_committed_runbook_is_the_rendered_one():
    assert runbook.RUNBOOK_PATH.read_text() == runbook.render(), "run: python -m gemma_nb runbook"


def test_the_figures_are_recomputed_from_catalog_and_story():
    f = runbook.figures()
    assert f["compile_usd"] == pytest.approx(CLAIMS["compile_minutes"].value / 60 * INSTANCES["inf2.8xlarge"].usd_per_hour)
    assert f["cold_start_usd"] == pytest.approx(CLAIMS["cold_start_s"].value / 3600 * INSTANCES["inf2.xlarge"].usd_per_hour)
    assert f["usd_per_m_tokens"] == pytest.approx(INSTANCES["inf2.xlarge"].usd_per_hour / (6 * 3600) * 1e6)
    assert round(f["answer_500_s"]) == CLAIMS["answer_500_tokens_s"].value  # the story's 83 s is 500 tokens at 6 tok/s
    assert f["fits"] and f["cheapest"] == "inf2.xlarge"
    # 180 GB on a 128 GiB box: 42.6 GB = 39.7 GiB short
    assert f["compile_swap_gib"] == 40 and f["serve_swap_gib"] == 0
    text = runbook.render()
    for stated in (f"${f['compile_usd']:.2f}", f"${f['cold_start_usd']:.2f}", f"${f['usd_per_m_tokens']:.2f} per million",
                   f"{f['per_rank_gb']:.2f} GB per NeuronCore", f"headroom {f['headroom_gb']:+.2f} to {f['headroom_gb_if_low']:+.2f} GB"):
        assert stated in text


def _commands(text):
    """Every ``python -m gemma_nb ...`` line of the code blocks, as argv lists (placeholders filled)."""
    lines = [m.group(1) for m in re.finditer(r"^\s{4,}python -m gemma_nb (.+)$", text, re.MULTILINE)]
    return [shlex.split(re.sub(r"<[^>]+>", "x", line.split("#")[0])) for line in lines]


def test_every_command_in_the_runbook_exists():
    from gemma_nb.serving.serve import build_parser as serve_parser

    commands = _commands(runbook.render())
    assert {c[0] for c in commands} == {"preflight", "run", "plan", "serve"}
    parser = build_parser()
    for argv in commands:
        if argv[0] == "serve":
            serve_parser().parse_args(argv[1:])
        else:
            args, rest = parser.parse_known_args(argv)
            assert not rest, f"unknown arguments {rest} in: python -m gemma_nb {' '.join(argv)}"


def test_runbook_notebook_parameters_exist():
    """-p NAME VALUE in the runbook names a parameter some notebook declares."""
    import json

    declared = set()
    for path in (REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if "parameters" in cell.get("metadata", {}).get("tags", []):
                declared |= set(re.findall(r"^(\w+)\s*=", "".join(cell["source"]), re.MULTILINE))
    for argv in _commands(runbook.render()):
        names = [argv[i + 1] for i, a in enumerate(argv) if a == "-p"]
        assert set(names) <= declared, names


def test_readme_links_the_runbook_and_says_smoke_run_first():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "](docs/inf2.md)" in readme
    assert "python -m gemma_nb run --target neuron" in readme and "first" in readme
