"""gemma_nb.experiments.compile_run: the size sweep of notebook 04, its fits, and its command's JSON
contract."""

import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb.experiments import compile_run  # noqa: E402


def test_fit_linear_recovers_a_line():
    fit = compile_run.fit_linear({"slope": [1, 2, 3, 4]}, [3.5, 5.5, 7.5, 9.5])
    assert (
        fit["slope"] == pytest.approx(2.0)
        and fit["intercept"] == pytest.approx(1.5)
        and fit["r2"] == pytest.approx(1.0)
    )
    with pytest.raises(ValueError, match="at least 2 points"):
        compile_run.fit_linear({"slope": [1]}, [2])


def test_command_prints_its_json_result_on_the_last_stdout_line(tmp_path):
    """``python -m gemma_nb.experiments.compile_run '<job>'``: the contract ``compile_sweep`` relies
    on."""
    dims = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        vocab_size=512,
    )
    job = {
        "dims": dims,
        "folder": str(tmp_path / "point"),
        "shapes": {"max_cache_len": 32, "prefill_len": 8},
    }
    done = subprocess.run(
        [sys.executable, "-m", "gemma_nb.experiments.compile_run", json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["layers"] == 1 and result["params"] > 0
    assert result["self_peak_rss_bytes"] >= result["held_rss_bytes"] > 0
    assert {"build_s", "weight_bytes", "export_s", "save_s"} <= set(result)
    assert (tmp_path / "point" / "manifest.json").is_file()
