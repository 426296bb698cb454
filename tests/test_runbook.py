"""docs/inf2.md: exactly what ``python -m gemma_nb runbook`` writes now, every command real, linked
from README."""

import json
import re
import shlex

import pytest

from gemma_nb.cli import build_parser
from gemma_nb.hardware import INSTANCES, GiB
from gemma_nb.paths import REPO_ROOT
from gemma_nb.story import CLAIMS
from gemma_nb.tools import runbook


def test_committed_runbook_is_the_rendered_one():
    assert runbook.RUNBOOK_PATH.read_text() == runbook.render(), "run: python -m gemma_nb runbook"


def test_the_figures_are_recomputed_from_catalog_and_story():
    f = runbook.figures()
    # two builds (the port's dense decode, the sparse fix), each at the port's 40 minutes
    assert f["compile_usd"] == pytest.approx(
        2 * CLAIMS["compile_minutes"].value / 60 * INSTANCES["inf2.8xlarge"].usd_per_hour
    )
    assert f["cold_start_usd"] == pytest.approx(
        CLAIMS["cold_start_s"].value / 3600 * INSTANCES["inf2.xlarge"].usd_per_hour
    )
    assert f["usd_per_m_tokens"] == pytest.approx(
        INSTANCES["inf2.xlarge"].usd_per_hour / (6 * 3600) * 1e6
    )
    # the story's 83 s is 500 tokens at 6 tok/s
    assert round(f["answer_500_s"]) == CLAIMS["answer_500_tokens_s"].value
    # a 512-slot cache after a full 128-token prefill holds 384 new tokens, not 500: the row uses
    # those
    assert (f["answer_tokens"], round(f["answer_s"])) == (384, 64) and f["answer_tokens"] < 500
    assert f["cheapest"] == "inf2.xlarge"  # the cheapest whose verdict is "fits"
    # the port's swap on the port's boxes: 100 GiB beside 128 GiB, 40 GiB beside 16 GiB
    assert (f["compile_need_gib"], f["compile_swap_gib"]) == (228, 100)
    assert (f["serve_need_gib"], f["serve_swap_gib"]) == (56, 40)
    # torch.jit.load holds model.pt beside the port's RSS peak: more than the serving box's RAM
    assert f["deploy_load_gb"] * 1e9 > INSTANCES["inf2.xlarge"].host_ram_bytes
    text = runbook.render()
    for stated in (
        f"USD {f['compile_usd']:.2f}",
        f"USD {f['cold_start_usd']:.2f}",
        f"USD {f['usd_per_m_tokens']:.2f} per M tokens",
        f"{f['per_rank_gb']:.2f} GB per NeuronCore",
        f"headroom {f['headroom_gb']:+.2f} to {f['headroom_gb_if_low']:+.2f} GB",
    ):
        assert stated in text


def test_runbook_plan_and_preflight_hold_a_box_to_the_same_ram_and_swap():
    from gemma_nb.memory import load_gemma4_26b_config
    from gemma_nb.tools import plan as planner
    from gemma_nb.tools import preflight as P

    f, text = runbook.figures(), runbook.render()
    host = planner.plan_report(
        load_gemma4_26b_config(), "int8_squeeze", 2, 512, "inf2.xlarge", name="26b"
    )["host"]
    for step, box, need_gib in (
        ("compile", "inf2.8xlarge", f["compile_need_gib"]),
        ("deploy", "inf2.xlarge", f["serve_need_gib"]),
    ):
        need = host[f"{step}_bytes"]
        assert need == need_gib * GiB  # plan's figure is the runbook's
        # the swap command the runbook gives, sized from the RAM the box reads
        assert (
            f"fallocate -l $(( {need_gib:g} - $(free -g | awk '/^Mem:/ {{print $2}}') ))G" in text
        )
        ram = INSTANCES[box].host_ram_bytes - 3 * GiB  # a box reads less than its nominal
        swap_gib = need_gib - INSTANCES[box].host_ram_gib + 3  # the formula's size on this box
        for swap, status in ((swap_gib, P.OK), (swap_gib - 1, P.FAIL)):
            check = P.check_host_memory(P.System(memory=lambda s=swap: (ram, s * GiB)), step, need)
            assert check.status == status, check
        short = P.check_host_memory(P.System(memory=lambda: (ram, 0)), step, need)
        assert short.status == P.FAIL and f"fallocate -l {swap_gib:g}G /swapfile " in short.fix


def _commands(text):
    """Every ``python -m gemma_nb ...`` line of the code blocks, as argv lists (placeholders
    filled)."""
    lines = [
        m.group(1) for m in re.finditer(r"^\s{4,}python -m gemma_nb (.+)$", text, re.MULTILINE)
    ]
    return [shlex.split(re.sub(r"<[^>]+>", "x", line.split("#")[0])) for line in lines]


def test_every_command_in_the_runbook_exists(monkeypatch):
    from gemma_nb import plan_input

    # plan reads its config as it parses; the runbook's folders are on the box, not here
    monkeypatch.setattr(plan_input, "read_raw_config", lambda path: path)
    commands = _commands(runbook.render())
    assert {c[0] for c in commands} == {"preflight", "run", "plan", "serve"}
    parser = build_parser()
    for argv in commands:
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


def test_the_runbook_picks_the_sdk_2_31_image_and_installs_without_replacing_the_sdk_s_numpy():
    text = runbook.render()
    assert "**of the Neuron SDK 2.31 release**, picked by name" in text and "neuron-dlami" in text
    assert "sh envs/neuron/install.sh" in text and "\n    pip install -e .\n" not in text
    install = (REPO_ROOT / "envs" / "neuron" / "install.sh").read_text()
    assert "pip install --quiet --no-deps -e ." in install and '-c "$pins"' in install
    notebooks = (REPO_ROOT / "envs" / "neuron" / "notebooks.txt").read_text().lower()
    assert "numpy" not in notebooks.split("\n#")[-1] and "\ntorch" not in notebooks
    assert "pandas==3.1.1" in notebooks  # pinned as pyproject pins it


def test_the_disk_figures_are_the_rehearsal_s_builds_scaled_and_hold_both_builds():
    from gemma_nb.memory import load_gemma4_26b_config
    from gemma_nb.tools import plan as planner

    f, disk = (
        runbook.figures(),
        planner.disk_needs(load_gemma4_26b_config(), planner.rehearsal_record()),
    )
    assert set(disk["builds"]) == {"dense", "sparse"}
    swapfile = f["serve_swap_gib"] * GiB  # the serving box's swapfile on the same volume
    assert f["serve_disk_gb"] == -(-(disk["serve_disk_bytes"] + swapfile) // 10**9)
    # no second copy
    assert disk["serve_disk_bytes"] == sum(b["artifact_bytes"] for b in disk["builds"].values())
    assert f["compile_disk_gb"] > f["serve_disk_gb"] > 2 * 26


def test_readme_links_the_runbook_and_says_smoke_run_first():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "](docs/inf2.md)" in readme
    assert "python -m gemma_nb run --target neuron" in readme and "first" in readme


def test_the_26b_quality_step_states_notebook_02s_estimates():
    quality = json.loads(runbook.QUALITY_METRICS.read_text())["metrics"]  # the reference run's
    text = runbook.render()
    peak_gb, (low, high) = quality["predicted_26b_eval_host_peak_gb"], quality["eval_26b_hours"]
    assert f"~{peak_gb:.0f} GB, within the inf2.8xlarge's 128 GiB" in text
    assert peak_gb * 1e9 < INSTANCES["inf2.8xlarge"].host_ram_bytes
    assert f"| {low:.1f} to {high:.1f} h (estimated) |" in text
    assert f"-p eval_text {runbook.WIKITEXT}" in text and "run --target cpu --only 02" in text
