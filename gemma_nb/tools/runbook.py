"""``python -m gemma_nb runbook``: writes ``docs/inf2.md``, the step-by-step way from an AWS account to
the 26B answering on an inf2.xlarge, with every figure computed here.

Figures come from the instance catalog (``gemma_nb.hardware``: host RAM, NeuronCores, on-demand
$/h), the planner (``gemma_nb.tools.plan`` on the bundled 26B config: bytes per rank, host RAM for the
compile and the deploy; disk, from ``make rehearse``'s measured builds in ``docs/rehearsal.json``),
the shipped build's shapes (``gemma_nb.neuron.build``) and the port's measured timings
(``gemma_nb.story``). The commands are :data:`COMMANDS`, which ``make rehearse``
(``gemma_nb.rehearsal.rehearse``) runs in order. ``tests/test_runbook.py`` checks that the committed
file is exactly what this module renders now, and that every ``python -m gemma_nb`` command in it parses.
"""

from __future__ import annotations

import math
import sys

from gemma_nb import memory
from gemma_nb.hardware import GB, INSTANCES, GiB
from gemma_nb.neuron.build import NeuronBuildConfig
from gemma_nb.paths import REPO_ROOT
from gemma_nb.story import CLAIMS
from gemma_nb.tools import plan as planner

RUNBOOK_PATH = REPO_ROOT / "docs" / "inf2.md"
COMPILE_BOX, SERVE_BOX = "inf2.8xlarge", "inf2.xlarge"
MODEL_DIR = "/data/gemma-4-26b-a4b-it"
OUTPUTS = "outputs/neuron"
ARTIFACT_DIRS = {"dense": f"{OUTPUTS}/artifacts/04_neuron_dense", "sparse": f"{OUTPUTS}/artifacts/04_neuron_sparse"}
HUB_ID = "google/gemma-4-26B-A4B-it"
DLAMI = "Deep Learning AMI Neuron PyTorch 2.9 (Ubuntu 24.04)"

# Every command the runbook tells a user to run, by step; make rehearse runs these.
COMMANDS = {
    "install": ["source /opt/aws_neuronx_venv_pytorch_2_9/bin/activate",
                "git clone <this repository> gemma-nb && cd gemma-nb",
                "pip install -r envs/neuron/requirements.txt",
                "sh envs/neuron/install.sh"],
    "preflight": ["python -m gemma_nb preflight --target neuron"],
    "smoke": ["python -m gemma_nb run --target neuron"],
    "download": ["export HF_TOKEN=<your token>          # Gemma is gated: accept its licence on the hub first",
                 f"hf download {HUB_ID} --local-dir {MODEL_DIR}",
                 f"python -m gemma_nb plan {MODEL_DIR} --instance {SERVE_BOX}",
                 f"python -m gemma_nb preflight --target neuron --model-id {MODEL_DIR}"],
    "compile": [f"python -m gemma_nb run --target neuron --only 04 -p neuron_model_dir {MODEL_DIR}"],
    "copy": [f"rsync -a --partial --exclude compiler_workdir {OUTPUTS}/ <serving-box>:gemma-nb/{OUTPUTS}/",
             "python -m gemma_nb preflight --target neuron " + " ".join(f"--artifact {f}" for f in ARTIFACT_DIRS.values())],
    "benchmark": ["python -m gemma_nb run --target neuron --only 05,07"],
    "serve": ["export GEMMA_NB_API_KEY=<a key>      # required by clients once set; never pass it as a flag",
              f"python -m gemma_nb serve --target neuron --artifact {ARTIFACT_DIRS['sparse']} --host 0.0.0.0 --port 8080"],
}


def _block(step: str) -> str:
    return "\n".join(f"    {line}" for line in COMMANDS[step])


def figures() -> dict:
    """Every number the runbook states, computed from the catalog, the planner and the story's timings."""
    config = memory.load_gemma4_26b_config()
    report = planner.plan_report(config, "int8_squeeze", 2, memory.SHIPPED_CONTEXT_LEN, SERVE_BOX,
                                 name="gemma4_26b_a4b.json")
    host, record = report["host"], planner.rehearsal_record()
    disk = planner.disk_needs(config, record)
    compile_box, serve_box = INSTANCES[COMPILE_BOX], INSTANCES[SERVE_BOX]
    compile_swap_gib = max(0, math.ceil((host["compile_bytes"] - compile_box.host_ram_bytes) / GiB))
    serve_swap_gib = max(0, math.ceil((host["deploy_bytes"] - serve_box.host_ram_bytes) / GiB))
    shipped = NeuronBuildConfig(model_dir="", output_dir="")
    answer_tokens = shipped.max_len - shipped.bucket  # the longest answer after a full prefill bucket
    compile_min, decode_tok_s = CLAIMS["compile_minutes"].value, CLAIMS["decode_tok_s"].value
    steps = record["steps"]
    return {
        "per_rank_gb": report["total_gb_per_rank"],
        "hbm_per_core_gb": report["budget_gb_per_core"],
        "headroom_gb": report["headroom_gb"],
        "headroom_gb_if_low": report["headroom_gb_if_low"],
        "allowance_low_gb": report["runtime_allowance"]["low_gb"],
        "allowance_high_gb": report["runtime_allowance"]["high_gb"],
        "fits": report["fits"],
        "cheapest": report["cheapest_fit"]["instance"] if report["cheapest_fit"] else None,
        "compile_host_gb": host["compile_bytes"] / GB, "deploy_host_gb": host["deploy_bytes"] / GB,
        "compile_ram_gib": compile_box.host_ram_gib, "serve_ram_gib": serve_box.host_ram_gib,
        "compile_swap_gib": compile_swap_gib, "serve_swap_gib": serve_swap_gib,
        "checkpoint_gb": disk["checkpoint_bytes"] / GB,
        "build_gb": {name: b["artifact_bytes"] / GB for name, b in disk["builds"].items()},
        "workdir_gb": {name: b["compiler_workdir_bytes"] / GB for name, b in disk["builds"].items()},
        "compile_disk_gb": math.ceil(disk["compile_disk_bytes"] / GB + (compile_swap_gib + 1) * GiB / GB),
        "serve_disk_gb": math.ceil(disk["serve_disk_bytes"] / GB),
        "compile_usd_h": compile_box.usd_per_hour, "serve_usd_h": serve_box.usd_per_hour,
        "compile_min": compile_min, "builds": len(disk["builds"]),
        "compile_usd": len(disk["builds"]) * compile_min / 60 * compile_box.usd_per_hour,
        "neff_gb": CLAIMS["neff_gb"].value, "neff_load_s": CLAIMS["neff_load_s"].value,
        "cold_start_s": CLAIMS["cold_start_s"].value,
        "cold_start_usd": CLAIMS["cold_start_s"].value / 3600 * serve_box.usd_per_hour,
        "decode_tok_s": decode_tok_s, "max_len": shipped.max_len, "bucket": shipped.bucket,
        "answer_tokens": answer_tokens, "answer_s": answer_tokens / decode_tok_s,
        "answer_500_s": 500 / decode_tok_s,
        "usd_per_m_tokens": serve_box.usd_per_hour / (decode_tok_s * 3600) * 1e6,
        "serve_day_usd": 24 * serve_box.usd_per_hour,
        "rehearsal_ok": sum(step["status"] == "ok" for step in steps), "rehearsal_steps": len(steps),
        "rehearsal_torch": sorted({step["torch"] for step in steps}),
        "rehearsal_answers": sorted({b["answer"] for b in record["builds"].values()} | {record["serve"]["answer"]}),
    }


def render() -> str:
    """docs/inf2.md, section by section."""
    f = figures()
    return "".join(section(f) for section in (_title, _costs, _launch_install_preflight, _smoke_download_compile,
                                             _copy_deploy_serve))


def _title(f: dict) -> str:
    """The title, the generated-file note and the status."""
    return f"""# From an AWS account to the 26B on an inf2.xlarge: the runbook

<!-- Generated by `python -m gemma_nb runbook` from gemma_nb/hardware.py (catalog), gemma_nb/tools/plan.py,
gemma_nb/story.py (the port's measured timings) and docs/rehearsal.json (make rehearse's record). Do not
edit by hand: tests/test_runbook.py fails when this file differs from what the command writes. -->

**Status: not run on an Inferentia machine.** No inf2 was available to this project. What a cpu can
do instead is `make rehearse`: it runs this runbook's commands of steps 2-4 and 7-9, in order, on a cpu
box at the SDK's own torch, against an emulation of the Neuron SDK surface this repository calls
(`gemma_nb.rehearsal`: NxD's layers, ModelBuilder, NxDModel, `torch.jit.load`, NeuronCores with an
HBM budget). Its last record (`docs/rehearsal.json`): {f['rehearsal_ok']} of {f['rehearsal_steps']} steps ok
on torch {', '.join(f['rehearsal_torch'])}; both builds and the server answered
{' / '.join(repr(a) for a in f['rehearsal_answers'])} to "The capital of France is". That proves this
repository's commands, files and graphs against the SDK's documented contracts. Only an inf2 proves the
rest: that neuronx-cc accepts the graphs, that the model fits the HBM, and the speed. That is why the
first thing to run on a new box is the tiny smoke run (step 4): it takes the 26B's code path with a
model small enough to fail in minutes, not after a {f['compile_min']:g}-minute compile.

"""


def _costs(f: dict) -> str:
    """What the two boxes cost, from the catalog and the port's timings."""
    return f"""## What it costs

Two boxes, as the port did: the compile needs host RAM, not NeuronCores, and the serving box needs
HBM. Prices are AWS on-demand, us-east-1 (`gemma_nb.hardware.INSTANCES`); times are the port's
measured ones (`gemma_nb.story`); GB = 10^9 bytes.

| step | box | time | cost |
|---|---|---|---|
| compile the 26B twice (dense decode, sparse) | {COMPILE_BOX} (${f['compile_usd_h']:.4f}/h) | {f['builds']} x {f['compile_min']:g} min (the port's) | ${f['compile_usd']:.2f} |
| cold start: fresh instance to ready | {SERVE_BOX} (${f['serve_usd_h']:.4f}/h) | {f['cold_start_s']:g} s, of which NEFF load {f['neff_load_s']:g} s | ${f['cold_start_usd']:.2f} |
| longest answer, {f['answer_tokens']} tokens, at {f['decode_tok_s']:g} tok/s (DenseExperts) | {SERVE_BOX} | {f['answer_s']:.0f} s | ${f['usd_per_m_tokens']:.2f} per M tokens |
| serving, a whole day | {SERVE_BOX} | 24 h | ${f['serve_day_usd']:.2f} |
| tiny smoke run (step 4) | either | not measured here | the box's $/h |

The longest answer is the shipped build's: its KV cache holds {f['max_len']} tokens, a full prefill bucket
{f['bucket']} of them, so an answer has at most {f['answer_tokens']} tokens (the write-up's 500-token answer in {f['answer_500_s']:.0f} s would need a longer cache).

The planner's figures for the 26B (`python -m gemma_nb plan gemma_nb/configs/gemma4_26b_a4b.json`):
{f['per_rank_gb']:.2f} GB per NeuronCore at TP=2 with the int8 squeeze and a 512-token KV cache, runtime
allowance included, against {f['hbm_per_core_gb']:.2f} GB (16 GiB) per core: headroom {f['headroom_gb']:+.2f} to {f['headroom_gb_if_low']:+.2f} GB,
as the Neuron runtime takes {f['allowance_high_gb']:.2f} to {f['allowance_low_gb']:.2f} GB per core (the window notebook 01 infers
from the port's failed and shipped builds); the cheapest instance that fits is the {f['cheapest']}. Host RAM, the port's measured peaks scaled by the planner:
the compile needs ~{f['compile_host_gb']:.0f} GB (the {COMPILE_BOX} has {f['compile_ram_gib']:g} GiB: add at least
{f['compile_swap_gib']} GiB of swap), the deploy ~{f['deploy_host_gb']:.0f} GB (the {SERVE_BOX} has
{f['serve_ram_gib']:g} GiB{': no swap needed by this scaling' if not f['serve_swap_gib'] else f": add {f['serve_swap_gib']} GiB of swap"}; `preflight` checks the box you have).

"""


def _disk_words(f: dict) -> str:
    builds = ", ".join(f"{name} {gb:.1f} GB" for name, gb in f["build_gb"].items())
    workdirs = ", ".join(f"{name} {gb:.1f} GB" for name, gb in f["workdir_gb"].items())
    return (f"each build's artifact folder ({builds}) and its compiler workdir ({workdirs}), "
            f"scaled by the planner from `make rehearse`'s builds of the tiny checkpoint on disk")


def _launch_install_preflight(f: dict) -> str:
    """Steps 1-3: launch, install, preflight."""
    return f"""## 1. Launch the instances

- AMI: the AWS "{DLAMI}" **of the Neuron SDK 2.31 release**, picked by name and
  release: the Neuron SDK 2.31 driver, runtime, `neuron-ls`, and a virtual environment at
  `/opt/aws_neuronx_venv_pytorch_2_9`. Later Neuron DLAMIs no longer ship torch-neuronx for PyTorch 2.9
  (2.32 dropped it; PyTorch 2.9 images are not published after 2.31: `docs/sources.md`, `neuron-dlami`),
  so the newest AMI is not the one.
- Compile box: {COMPILE_BOX}, an EBS volume of at least {f['compile_disk_gb']} GB: the checkpoint's text
  weights in bf16 ({f['checkpoint_gb']:.1f} GB; the hub folder also holds the vision and audio towers: add their
  size), {_disk_words(f)}, and the swap file, plus the AMI's own root
  volume. The emulated SDK writes no NEFF: compare the port's {f['neff_gb']:g} GB.
- Serving box: {SERVE_BOX}, an EBS volume of at least {f['serve_disk_gb']} GB for both builds' artifact folders
  (the compiler workdir stays behind; a run with `--only` links them, it does not copy them), plus
  the AMI's own root volume.
- Swap on the compile box (size from the table above; `preflight` prints the exact command for the box):

      sudo fallocate -l {f['compile_swap_gib'] + 1}G /swapfile && sudo chmod 600 /swapfile && sudo mkswap /swapfile && sudo swapon /swapfile

## 2. Install

{_block('install')}

`envs/neuron/install.sh` installs the notebooks' and the server's packages pinned as `pyproject.toml`
pins them, constrained to the SDK's own torch and numpy (pip stops with an error rather than replace
them), then this package with `--no-deps`: a plain `pip install -e .` would pull `pyproject.toml`'s
numpy and pandas over the SDK's. neuronx-distributed imports `transformers.utils.fx`, which transformers 5
removed; `gemma_nb` detects that when it imports the SDK (`gemma_nb.neuron.sdk`) and supplies a stand-in
module (only NxD's pipeline-parallel tracing of Hugging Face models, unused here, becomes unavailable),
and says so when it does.

## 3. Preflight

{_block('preflight')}

A checklist: the SDK imports (and whether the transformers-5 workaround was needed), versions
against `envs/neuron/requirements.txt` (a wheel's local `+...` label is not a difference), NeuronCores
and HBM per core (`neuron-ls`), RAM and swap against the step, free disk against this runbook's
figure, the model folder. It exits non-zero naming the first blocker and its fix.

"""


def _smoke_download_compile(f: dict) -> str:
    """Steps 4-6: the tiny smoke run, the 26B's download and plan, its compile."""
    return f"""## 4. The tiny smoke run: run this first

{_block('smoke')}

With the default `model_id`, the neuron target compiles the bundled tiny Gemma-4 MoE's TP=2 twin
(attention heads, KV heads and experts divisible by 2, stored the way the hub stores the 26B: sharded
safetensors with an index, the multimodal key prefix and config) through the 26B's exact code path,
twice: the dense decode (the port's, with its compiler flags) and the sparse one (the fix). Then the
artifact folders, the slim deploy of each, a greedy answer, the decode benchmark of both, one after
the other. It compiles at a small cache and bucket and skips the cpu-only measurements of the
notebooks, which the committed cpu run holds, so it takes minutes. Outputs go to `{OUTPUTS}/`.

## 5. Download the 26B and plan it

{_block('download')}

`plan` reads only the folder's `config.json`; `preflight --model-id` checks the folder holds the
config, the tokenizer and every safetensors shard its index names. The token is read from the
environment only and never printed or written out.

## 6. Compile the 26B (on the {COMPILE_BOX})

{_block('compile')}

`neuron_model_dir` is what the neuron compile reads; `model_id` stays the bundled checkpoint, which
notebook 04's cpu sections export for notebook 05. Notebook 04 compiles both decode paths
(`decode_experts`, default `["dense", "sparse"]`; `-p decode_experts '["sparse"]'` for one), each
about {f['compile_min']:g} minutes in the port's run, one artifact folder each:
`{ARTIFACT_DIRS['dense']}` and `{ARTIFACT_DIRS['sparse']}`, holding the traced model, the host
embedding with its scale self-check data, config, tokenizer, the build record (versions, flags,
graphs, the SDK) and a manifest of every file and its size.

"""


def _copy_deploy_serve(f: dict) -> str:
    """Steps 7-9 and where this repository stops."""
    return f"""## 7. Copy the outputs to the {SERVE_BOX}

{_block('copy')}

The serving box needs no checkpoint: the deploy reads only the artifact folders, and notebook 05's
cpu sections read what notebook 04 wrote beside them. The deploy checks every file against the
manifest's sizes, so a truncated copy fails at load, with the fix, not as a wrong answer.

## 8. Deploy and benchmark (on the {SERVE_BOX})

{_block('benchmark')}

Notebook 05 deploys each build (NEFF load time, peak host RSS, a greedy answer); notebook 07 times
the decode of both, one after the other. Between two builds the Neuron runtime is closed
(`torch.classes.neuron.Runtime().unsafe_close()`): one 26B build fills most of both NeuronCores, and
dropping the Python references does not unload it. Builds kept elsewhere are passed with
`-p neuron_artifacts '["<folder>", ...]'`.

## 9. Serve

{_block('serve')}

and measure it from anywhere with:

    python -m gemma_nb run --target cpu --only 07 -p endpoint http://<serving-box>:8080/v1

## Where this repository stops

This server reproduces the port's single-model container: one generation at a time, one KV cache,
batch 1. For many users or bigger boxes, serve with an existing engine (vLLM's Neuron backend or
NxD Inference on trn/inf, vLLM on GPUs) and point notebook 07's `endpoint` at it: the same
benchmark then measures that server.
"""


def add_arguments(parser) -> None:
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/inf2.md differs from what it would write")


def main(args) -> int:
    text = render()
    if args.check:
        current = RUNBOOK_PATH.read_text() if RUNBOOK_PATH.is_file() else ""
        if current != text:
            print("docs/inf2.md is out of date: run python -m gemma_nb runbook", file=sys.stderr)
            return 1
        return 0
    RUNBOOK_PATH.parent.mkdir(parents=True, exist_ok=True)
    RUNBOOK_PATH.write_text(text)
    print(f"wrote {RUNBOOK_PATH.relative_to(REPO_ROOT)}")
    return 0
