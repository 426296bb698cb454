"""What notebooks 04, 05 and 07 run on the neuron target: every build compiled, deployed and
answered in turn."""

from pathlib import Path

import pandas as pd
from transformers import AutoTokenizer

from gemma_nb.bench import time_runners
from gemma_nb.neuron.artifact import artifact_labels, default_artifact_dir
from gemma_nb.neuron.build import NeuronBuildConfig, compile_neuron
from gemma_nb.neuron.deploy import deployed_answer, release, slim_deploy, until_eos
from gemma_nb.tiny import TP2_CHECKPOINT_DIR

# the bundled TP=2 checkpoint's smoke run: KV slots, prefill bucket
SMOKE_SHAPES = {
    "max_len": 64,
    "bucket": 16,
}


def compile_builds(model_dir: str | Path, target: str, decode_experts) -> dict:
    """``compile_neuron``'s records, once per decode path in order (the bundled TP=2 checkpoint at
    ``SMOKE_SHAPES``)."""
    shapes = dict(SMOKE_SHAPES) if Path(model_dir).resolve() == TP2_CHECKPOINT_DIR.resolve() else {}
    decodes = [decode_experts] if isinstance(decode_experts, str) else decode_experts
    return {
        decode: compile_neuron(
            NeuronBuildConfig(
                str(model_dir),
                str(default_artifact_dir(target, decode)),
                decode_experts=decode,
                **shapes,
            )
        )
        for decode in decodes
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


def answer_each(
    folders, prompt: str = "The capital of France is", max_new_tokens: int = 16
) -> list[dict]:
    """Per artifact folder, deployed and released in turn: its decode graph, greedy answer, NEFF
    load time, peak RSS."""
    rows = []
    for folder in folders:
        runner, figures = slim_deploy(folder)
        try:
            answer = deployed_answer(runner, folder, prompt, max_new_tokens)
        finally:
            release(runner)
        rows.append(
            {
                "build": Path(folder).name,
                "decode_graph": figures["decode_graph"],
                "completion": answer["completion"],
                "new_tokens": answer["new_tokens"],
                "neff_load_s": figures["neff_load_s"],
                "peak_host_rss_bytes": figures["peak_host_rss_bytes"],
                "sdk": figures["sdk"],
            }
        )
    return rows


def benchmark_builds(
    folders, prompt: str = "The capital of France is", new_tokens: int = 32, repeats: int = 3
):
    """Each build's decode speed and continuation (notebook 07), deployed and released in turn: two
    26B builds do not fit."""
    builds = artifact_labels(folders)
    tokenizer = AutoTokenizer.from_pretrained(str(next(iter(builds.values()))))
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    tables = []
    for name, folder in builds.items():
        runner, figures = slim_deploy(folder)
        try:
            table = time_runners({name: runner}, ids, new_tokens=new_tokens, repeats=repeats)
        finally:
            release(runner)
        tables.append(
            table.assign(neff_load_s=figures["neff_load_s"], decode_graph=figures["decode_graph"])
        )
    table, eos = pd.concat(tables), tokenizer.eos_token_id
    return table.assign(
        completion=[
            tokenizer.decode(until_eos(list(t)[ids.shape[1] :], eos)).strip()
            for t in table["tokens"]
        ]
    )
