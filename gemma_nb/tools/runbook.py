"""``python -m gemma_nb runbook``: writes docs/inf2.md, the way from an AWS account to the 26B on an
inf2.xlarge, from the template ``runbook.md`` and figures computed from the catalog, the planner and
the story."""

import json
import math
import sys
from pathlib import Path

from gemma_nb import memory
from gemma_nb.hardware import GB, INSTANCES, GiB
from gemma_nb.neuron.build import NeuronBuildConfig
from gemma_nb.paths import OUTPUTS_DIR, REPO_ROOT
from gemma_nb.story import CLAIMS
from gemma_nb.tools import plan as planner

RUNBOOK_PATH = REPO_ROOT / "docs" / "inf2.md"
TEMPLATE = Path(__file__).with_name("runbook.md")
COMPILE_BOX, SERVE_BOX = "inf2.8xlarge", "inf2.xlarge"
MODEL_DIR = "/data/gemma-4-26b-a4b-it"
OUTPUTS = "outputs/neuron"
ARTIFACT_DIRS = {
    "dense": f"{OUTPUTS}/artifacts/04_neuron_dense",
    "sparse": f"{OUTPUTS}/artifacts/04_neuron_sparse",
}
HUB_ID = "google/gemma-4-26B-A4B-it"
WIKITEXT = "/data/wikitext-2-raw/wiki.test.raw"  # llama.cpp's copy of wikitext-2, on the hub
# notebook 02's reference run: its scaled estimates of the 26B evaluation
QUALITY_METRICS = OUTPUTS_DIR / "cpu" / "metrics" / "02_quantization.json"
DLAMI = "Deep Learning AMI Neuron PyTorch 2.9 (Ubuntu 24.04)"

# The commands the runbook gives, by step; make rehearse runs them.
COMMANDS = {
    "install": [
        "source /opt/aws_neuronx_venv_pytorch_2_9/bin/activate",
        "git clone <this repository> gemma-nb && cd gemma-nb",
        "pip install -r envs/neuron/requirements.txt",
        "sh envs/neuron/install.sh",
    ],
    "preflight": ["python -m gemma_nb preflight --target neuron"],
    "smoke": ["python -m gemma_nb run --target neuron"],
    "download": [
        "export HF_TOKEN=<your token>          # Gemma is gated: accept its licence on the hub "
        "first",
        f"hf download {HUB_ID} --local-dir {MODEL_DIR}",
        f"python -m gemma_nb plan {MODEL_DIR} --instance {SERVE_BOX}",
        f"python -m gemma_nb preflight --target neuron --model-id {MODEL_DIR}",
    ],
    "quality": [
        "hf download ggml-org/ci wikitext-2-raw-v1.zip --repo-type dataset --local-dir /data",
        "python -m zipfile -e /data/wikitext-2-raw-v1.zip /data",
        "python -m gemma_nb run --target cpu --only 02 --output-dir outputs/quality-26b -p threads "
        f"{INSTANCES[COMPILE_BOX].vcpus} -p model_id {MODEL_DIR} -p eval_text {WIKITEXT}",
    ],
    "compile": [
        f"python -m gemma_nb run --target neuron --only 04 -p neuron_model_dir {MODEL_DIR}"
    ],
    "copy": [
        f"rsync -a --partial --exclude compiler_workdir {OUTPUTS}/ "
        f"<serving-box>:gemma-nb/{OUTPUTS}/",
        "python -m gemma_nb preflight --target neuron "
        + " ".join(f"--artifact {f}" for f in ARTIFACT_DIRS.values()),
    ],
    "benchmark": ["python -m gemma_nb run --target neuron --only 05,07"],
    "serve": [
        "export GEMMA_NB_API_KEY=<a key>      # required by clients once set; never pass it as a "
        "flag",
        f"python -m gemma_nb serve --target neuron --artifact {ARTIFACT_DIRS['sparse']} --host "
        "0.0.0.0 --port 8080",
    ],
    "measure": [
        "export GEMMA_NB_API_KEY=<the server's key>",
        "python -m gemma_nb run --target cpu --only 07 -p endpoint http://<serving-box>:8080/v1",
    ],
}


def figures() -> dict:
    """Every figure the runbook states (numbers and their phrases), from the catalog, the planner
    and the story's timings."""
    config = memory.load_gemma4_26b_config()
    report = planner.plan_report(
        config, "int8_squeeze", 2, memory.SHIPPED_CONTEXT_LEN, SERVE_BOX, name="gemma4_26b_a4b.json"
    )
    host, record = report["host"], planner.rehearsal_record()
    disk = planner.disk_needs(config, record)
    compile_box, serve_box = INSTANCES[COMPILE_BOX], INSTANCES[SERVE_BOX]
    compile_swap_gib = host["compile_bytes"] / GiB - compile_box.host_ram_gib
    serve_swap_gib = host["deploy_bytes"] / GiB - serve_box.host_ram_gib
    shipped = NeuronBuildConfig(model_dir="", output_dir="")
    # the longest answer after a full prefill bucket
    answer_tokens = shipped.max_len - shipped.bucket
    compile_min, decode_tok_s = CLAIMS["compile_minutes"].value, CLAIMS["decode_tok_s"].value
    steps = record["steps"]
    sizes = {
        key: ", ".join(f"{name} {b[key] / GB:.1f} GB" for name, b in disk["builds"].items())
        for key in ("artifact_bytes", "compiler_workdir_bytes")
    }
    boxes = {
        box: max(step["host_peak_gb"] for step in steps if step["box"] == box)
        for box in ("compile", "serving")
    }
    return {
        "per_rank_gb": report["total_gb_per_rank"],
        "hbm_per_core_gb": report["budget_gb_per_core"],
        "headroom_gb": report["headroom_gb"],
        "headroom_gb_if_low": report["headroom_gb_if_low"],
        "allowance_low_gb": report["runtime_allowance"]["low_gb"],
        "allowance_high_gb": report["runtime_allowance"]["high_gb"],
        "cheapest": report["cheapest_fit"]["instance"] if report["cheapest_fit"] else None,
        "compile_need_gib": host["compile_bytes"] / GiB,
        "serve_need_gib": host["deploy_bytes"] / GiB,
        "compile_peak_gb": host["compile_peak_bytes"] / GB,
        "model_pt_gb": host["model_pt_bytes"] / GB,
        "deploy_load_gb": host["deploy_load_bytes"] / GB,
        "deploy_peak_gb": CLAIMS["deploy_peak_rss_gb"].value,
        "compile_ram_gib": compile_box.host_ram_gib,
        "serve_ram_gib": serve_box.host_ram_gib,
        "compile_swap_gib": compile_swap_gib,
        "serve_swap_gib": serve_swap_gib,
        "compile_box_peak_gb": boxes["compile"],
        "compile_budget_gb": host["compile_bytes"] / GB,
        "serve_budget_gb": host["deploy_bytes"] / GB,
        "serve_box_peak_gb": boxes["serving"],
        "checkpoint_gb": disk["checkpoint_bytes"] / GB,
        "disk_words": f"each build's artifact folder ({sizes['artifact_bytes']}) and its "
        f"compiler workdir ({sizes['compiler_workdir_bytes']}), scaled by the planner from "
        "`make rehearse`'s builds of the tiny checkpoint on disk",
        "compile_disk_gb": math.ceil((disk["compile_disk_bytes"] + compile_swap_gib * GiB) / GB),
        "serve_disk_gb": math.ceil((disk["serve_disk_bytes"] + serve_swap_gib * GiB) / GB),
        "compile_usd_h": compile_box.usd_per_hour,
        "serve_usd_h": serve_box.usd_per_hour,
        "compile_min": compile_min,
        "builds": len(disk["builds"]),
        "compile_usd": len(disk["builds"]) * compile_min / 60 * compile_box.usd_per_hour,
        "neff_gb": CLAIMS["neff_gb"].value,
        "neff_load_s": CLAIMS["neff_load_s"].value,
        "cold_start_s": CLAIMS["cold_start_s"].value,
        "cold_start_usd": CLAIMS["cold_start_s"].value / 3600 * serve_box.usd_per_hour,
        "decode_tok_s": decode_tok_s,
        "max_len": shipped.max_len,
        "bucket": shipped.bucket,
        "answer_tokens": answer_tokens,
        "answer_s": answer_tokens / decode_tok_s,
        "answer_500_s": 500 / decode_tok_s,
        "usd_per_m_tokens": serve_box.usd_per_hour / (decode_tok_s * 3600) * 1e6,
        "serve_day_usd": 24 * serve_box.usd_per_hour,
        "rehearsal_ok": sum(step["status"] == "ok" for step in steps),
        "rehearsal_steps": len(steps),
        "rehearsal_torch_words": ", ".join(sorted({step["torch"] for step in steps})),
        "rehearsal_answer_words": " / ".join(
            repr(answer)
            for answer in sorted(
                {b["answer"] for b in record["builds"].values()} | {record["serve"]["answer"]}
            )
        ),
    }


def render() -> str:
    blocks = {
        f"block_{step}": "\n".join(f"    {line}" for line in lines)
        for step, lines in COMMANDS.items()
    }
    return TEMPLATE.read_text().format(
        **figures(),
        **blocks,
        quality=json.loads(QUALITY_METRICS.read_text())["metrics"],
        COMPILE_BOX=COMPILE_BOX,
        SERVE_BOX=SERVE_BOX,
        DLAMI=DLAMI,
        OUTPUTS=OUTPUTS,
        artifact_dense=ARTIFACT_DIRS["dense"],
        artifact_sparse=ARTIFACT_DIRS["sparse"],
    )


def main(args) -> int:
    text = render()
    if args.check:
        if (RUNBOOK_PATH.read_text() if RUNBOOK_PATH.is_file() else "") == text:
            return 0
        print("docs/inf2.md is out of date: run python -m gemma_nb runbook", file=sys.stderr)
        return 1
    RUNBOOK_PATH.write_text(text)
    print(f"wrote {RUNBOOK_PATH.relative_to(REPO_ROOT)}")
    return 0
