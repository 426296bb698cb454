"""What notebooks 04, 05 and 07 run on the neuron target: every build compiled, deployed and
answered in turn, each in its own process. NxD traces in another process to release the Neuron
runtime (``trace/model_builder.py``), and a deploy's host memory (``torch.jit.load`` holds the whole
``model.pt``) and NeuronCores come back whole only when its process exits: two 26B builds never
share one."""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pandas as pd
from transformers import AutoTokenizer

from gemma_nb.bench import time_runners
from gemma_nb.neuron.build import NeuronBuildConfig
from gemma_nb.neuron.build_folder import artifact_labels, default_artifact_dir
from gemma_nb.neuron.deploy import slim_deploy, until_eos
from gemma_nb.peak_rss import MeasuredRun, run_measured
from gemma_nb.tiny import TP2_CHECKPOINT_DIR

# the bundled TP=2 checkpoint's smoke run: KV slots, prefill bucket
SMOKE_SHAPES = {
    "max_len": 64,
    "bucket": 16,
}
PROCESS_TIMEOUT_S = 4 * 3600  # a 26B compile took the port 40 minutes


def in_own_process(module: str, *args) -> MeasuredRun:
    """``python -m module *args`` in a fresh process: its JSON result (last stdout line), peaks."""
    argv = [sys.executable, "-m", module, *map(str, args)]
    return run_measured(argv, interval_s=1.0, timeout_s=PROCESS_TIMEOUT_S)


def compile_builds(model_dir: str | Path, target: str, decode_experts) -> dict:
    """``compile_neuron``'s records, once per decode path in order, each in its own process (the
    bundled TP=2 checkpoint at ``SMOKE_SHAPES``)."""
    shapes = dict(SMOKE_SHAPES) if Path(model_dir).resolve() == TP2_CHECKPOINT_DIR.resolve() else {}
    decodes = [decode_experts] if isinstance(decode_experts, str) else decode_experts
    builds = {
        decode: NeuronBuildConfig(
            str(model_dir),
            str(default_artifact_dir(target, decode)),
            decode_experts=decode,
            **shapes,
        )
        for decode in decodes
    }
    return {
        decode: in_own_process("gemma_nb.neuron.build", json.dumps(asdict(build))).result
        for decode, build in builds.items()
    }


def builds_table(records: dict):
    return pd.DataFrame(
        [
            {
                "decode_experts": name,
                "graphs": ", ".join(r["graphs"]),
                "compiler_args": r["build"]["compiler_args"],
                "sdk": r["sdk"],
                "max_len": r["build"]["max_len"],
                "bucket": r["build"]["bucket"],
                "compile_s": r["compile_s"],
                "peak_host_rss_gb": r["peak_host_rss_bytes"] / 1e9,
                "artifact_gb": r["artifact_bytes"] / 1e9,
                "neff_gb": r["neff_bytes"] / 1e9,
            }
            for name, r in records.items()
        ]
    ).set_index("decode_experts")


def deploy_and_decode(folder, ids: list[int], new_tokens: int, repeats: int) -> dict:
    """One build deployed in this process, its greedy decode of ``ids`` timed (``time_runners``)."""
    runner, figures = slim_deploy(folder)
    timed = time_runners({"build": runner}, [ids], new_tokens=new_tokens, repeats=repeats).iloc[0]
    return {key: figures[key] for key in ("decode_graph", "neff_load_s", "sdk")} | {
        key: timed[key] for key in ("ttft_s", "decode_tok_s", "tokens")
    }


def deploy_each(folders, prompt: str, new_tokens: int, repeats: int) -> pd.DataFrame:
    """``deploy_and_decode`` per build, each in its own process, in turn (notebooks 05, 07): a row
    per decode path with the continuation (cut at the first end-of-sequence) and the process's peak
    host RSS."""
    builds = artifact_labels(folders)
    tokenizer = AutoTokenizer.from_pretrained(str(next(iter(builds.values()))))
    ids, rows = tokenizer(prompt).input_ids, {}
    for name, folder in builds.items():
        run = in_own_process("gemma_nb.neuron.runs", folder, json.dumps(ids), new_tokens, repeats)
        new = until_eos(run.result["tokens"][len(ids) :], tokenizer.eos_token_id)
        rows[name] = run.result | {
            "build": folder.name,
            "completion": tokenizer.decode(new).strip(),
            "new_tokens": len(new),
            "peak_host_rss_bytes": run.peak_rss_bytes,
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def answer_each(
    folders, prompt: str = "The capital of France is", max_new_tokens: int = 16
) -> list[dict]:
    """Per build (notebook 05): its decode graph, greedy answer, NEFF load time, peak RSS, SDK."""
    table = deploy_each(folders, prompt, max_new_tokens, repeats=1)
    columns = ["build", "decode_graph", "completion", "new_tokens", "neff_load_s"]
    return table[columns + ["peak_host_rss_bytes", "sdk"]].to_dict(orient="records")


if __name__ == "__main__":
    folder, ids, new_tokens, repeats = sys.argv[1:]
    print(json.dumps(deploy_and_decode(folder, json.loads(ids), int(new_tokens), int(repeats))))
