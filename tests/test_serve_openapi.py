"""schemathesis against the server's own /openapi.json: no 5xx, no response off the documented
schema.

The server runs in-process on a loopback port with an API key; schemathesis 4 runs as the
command a deployer would type (``--checks all``, the key as a header), fuzzing every operation's
body with valid and invalid data, bounded in examples and seeded, so the run takes about a minute.
"""

import subprocess
import sys

import pytest
import torch

from gemma_nb.endpoint import wait_until_healthy
from gemma_nb.modelio import load_model
from gemma_nb.serving import app as served
from gemma_nb.serving.backends import TransformersRuntime
from gemma_nb.tiny import BUNDLED_ID

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "schemathesis-" + "k" * 16


def test_schemathesis_finds_no_server_error_and_no_schema_violation(serve_in_thread, tmp_path):
    torch.manual_seed(0)
    # Answers of at most 4 tokens keep each generated request cheap; the limits are otherwise the
    # defaults.
    app = served.create_app(
        TransformersRuntime(*load_model(BUNDLED_ID)),
        model_name=BUNDLED_ID,
        api_key=KEY,
        max_tokens=4,
        max_tokens_cap=4,
        allowed_hosts=served.LOOPBACK_HOSTS,
    )
    with serve_in_thread(app) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                f"{root}/openapi.json",
                "--checks",
                "all",
                "--header",
                f"Authorization: Bearer {KEY}",
                "--phases",
                "fuzzing",
                # 40 bodies an operation: with this seed each generation route got 14 or more
                # accepted and 14 or more refused ones; the check below asks for more than 5
                "--max-examples",
                "40",
                "--seed",
                "3",
                "--workers",
                "1",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,  # its cache goes there, not in the repo
        )
        fuzzed = served_requests(app)
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "No issues found" in run.stdout and "6 selected / 6 total" in run.stdout
    # Every generation route had bodies fuzzed: accepted ones and refused ones (400, 404 for a model
    # name).
    for path in served.GENERATION_PATHS:
        assert fuzzed.get((path, "200"), 0) > 5 and fuzzed.get((path, "400"), 0) > 5, (path, fuzzed)


def served_requests(app) -> dict:
    """(endpoint, status) -> responses, from the app's own /metrics counter."""
    counts = {}
    for metric in app.state.metrics.requests.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[(sample.labels["endpoint"], sample.labels["status"])] = sample.value
    return counts
