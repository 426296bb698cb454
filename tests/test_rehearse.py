"""make rehearse runs every runbook command as written but for its declared substitutions, each
within its box's RAM + swap at the 26B's scale; its record is the runbook's disk basis."""

import re
import subprocess

from gemma_nb.memory import load_gemma4_26b_config
from gemma_nb.paths import REPO_ROOT
from gemma_nb.rehearsal import rehearse as R
from gemma_nb.tools import plan as planner
from gemma_nb.tools import runbook

DECLARED = [old for old, _ in R.substitutions(port=8081)]


def _substituted(command: str, substitutions: dict) -> str:
    if not substitutions:
        return command
    pattern = "|".join(re.escape(old) for old in substitutions)
    return re.sub(pattern, lambda match: substitutions[match.group()], command)


def test_every_runbook_command_was_rehearsed_as_written_but_for_declared_substitutions():
    record, commands = planner.rehearsal_record(), R.runbook_commands(runbook.render())
    assert [(step["step"], step["runbook_command"]) for step in record["steps"]] == commands
    assert sorted({step for step, _ in commands}) == list(range(2, 10))
    for needle in (
        "gemma_nb plan /data/",
        "preflight --target neuron --model-id",
        "--only 04 -p neuron_model_dir",
        "rsync ",
        "gemma_nb serve ",
        "-p endpoint http://<serving-box>:8080/v1",
    ):
        assert any(needle in command for _, command in commands), needle
    for step in record["steps"]:
        assert step["status"] == "ok" and step["torch"].startswith(R.SDK_TORCH), step
        assert set(step["substitutions"]) <= set(DECLARED), step["substitutions"]
        assert _substituted(step["runbook_command"], step["substitutions"]) == step["as_run"]
        assert step["box"] == R.box_of(step["step"], step["runbook_command"])
    assert {b["answer"] for b in record["builds"].values()} == {"Paris ."}
    assert "Paris" in record["serve"]["answer"]
    for build in record["builds"].values():
        assert build["sdk"].startswith("emulated SDK")
        assert build["compiler_args"] == "--model-type transformer --auto-cast=none -O1"


def test_every_command_stayed_within_its_box_s_ram_and_swap_at_the_26b_s_scale():
    record, host = planner.rehearsal_record(), planner.host_needs(load_gemma4_26b_config())
    budgets = {"compile": host["compile_bytes"] / 1e9, "serving": host["deploy_bytes"] / 1e9}
    peaks = {"compile": 0.0, "serving": 0.0}
    for step in record["steps"]:
        assert step["host_budget_gb"] == round(budgets[step["box"]], 1)
        assert 0 <= step["host_peak_gb"] <= step["host_budget_gb"], step
        peaks[step["box"]] = max(peaks[step["box"]], step["host_peak_gb"])
    # the compile box held the compile's peak, the serving box a whole model.pt
    assert host["compile_peak_bytes"] / 1e9 < peaks["compile"] < budgets["compile"]
    assert host["model_pt_bytes"] / 1e9 < peaks["serving"] < budgets["serving"]


def test_a_substitute_is_never_substituted_again():
    rehearsal = R.Rehearsal.__new__(R.Rehearsal)
    rehearsal.port, rehearsal.torch, rehearsal.shells = 8081, "2.9.0", {"compile": {}}
    download = f"hf download {runbook.HUB_ID} --local-dir {runbook.MODEL_DIR}"
    entry = rehearsal.entry(5, download)
    assert entry["as_run"] == (
        "mkdir -p outputs/neuron-rehearsal/data && cp -r gemma_nb/tiny/checkpoint_tp2 "
        f"{R.MODEL_COPY}"
    )
    assert list(entry["substitutions"]) == [download]


def test_the_rehearsal_writes_into_its_own_ignored_folders():
    for folder in (R.REHEARSAL_DIR, *(REPO_ROOT / box for box in R.BOXES.values())):
        assert folder.is_relative_to(REPO_ROOT / "outputs" / "neuron-rehearsal")
        ignored = subprocess.run(["git", "check-ignore", "-q", str(folder / "x")], cwd=REPO_ROOT)
        assert ignored.returncode == 0, f"{folder} is not git-ignored"


def test_a_build_that_changed_on_disk_is_reported_with_the_fix():
    committed = planner.rehearsal_record()
    same = {"builds": {n: dict(b) for n, b in committed["builds"].items()}}
    assert R.disk_drift(same, committed) == []
    same["builds"]["sparse"]["artifact_bytes"] = int(
        committed["builds"]["sparse"]["artifact_bytes"] * 1.02
    )
    assert R.disk_drift(same, committed)[0].startswith("sparse: ")
    assert R.disk_drift(same, None) == ["docs/rehearsal.json is missing"]
