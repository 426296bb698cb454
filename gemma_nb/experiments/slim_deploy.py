"""Notebook 05 (slim deploy): the slim deploy (meta skeleton, host embedding, compiled steps)
against the naive one (the whole model on the host), each run by :func:`main` in a fresh process for
peak RSS and cold start."""

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache, Gemma4TextConfig

from gemma_nb import export, memory
from gemma_nb.embedding import host_embedding_for
from gemma_nb.evaluate import greedy_generate
from gemma_nb.experts import Int8Experts
from gemma_nb.metrics import headline
from gemma_nb.modelio import model_skeleton, quiet_loading, resolve_model_id
from gemma_nb.paths import fresh_dir
from gemma_nb.peak_rss import run_measured, self_peak_rss_bytes
from gemma_nb.quant import apply_scheme
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model

SQUEEZE = "int8_squeeze"
CHECKPOINT_DTYPE = torch.bfloat16  # what the hub ships for Gemma-4
# The 26B's architecture (64 experts, top-4: its 1/16 active; shared MLP 3x an expert's width) at
# ~0.67B parameters, 1.3 GB in bf16, 91% of it routed experts; four layers keep the exported graphs
# small.
DEPLOY_DIMS: dict = dict(
    hidden_size=1024,
    intermediate_size=2304,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    global_head_dim=256,
    num_global_key_value_heads=2,
    num_experts=64,
    top_k_experts=4,
    moe_intermediate_size=768,
    vocab_size=16384,
)
# notebook 05's performance targets: ratios measured in one run
SLIM_RSS_TARGET = 0.35
DECODE_LATENCY_TARGET = 1.3


def int8_squeeze(model: nn.Module):
    """Quantize ``model`` in place with the int8 squeeze, experts as traceable ``Int8Experts``;
    bytes per group."""
    report = apply_scheme(model, SQUEEZE)
    for layer in model.model.layers:
        layer.experts = Int8Experts.from_quantized(layer.experts)
    return report[["group", "format", "params", "stored_bytes"]]


def deploy_prompt(vocab_size: int, length: int) -> list[int]:
    """``length`` token ids drawn with seed 0 (ids 0-3 are reserved specials): the deploy prompt."""
    return torch.randint(
        4, vocab_size, (length,), generator=torch.Generator().manual_seed(0)
    ).tolist()


def save_random_checkpoint(folder: str | Path, dims: Mapping, seed: int = 0) -> dict:
    """A random bf16 Gemma-4 of ``dims`` saved with ``save_pretrained`` (reused if already there):
    params, bytes."""
    folder = Path(folder)
    marker = folder / "gemma_nb_random.json"
    wanted = {"dims": dict(dims), "seed": seed, "dtype": str(CHECKPOINT_DTYPE)}
    if marker.is_file() and json.loads(marker.read_text()).get("spec") == wanted:
        return json.loads(marker.read_text())["figures"]
    model = random_gemma4_model(random_gemma4_config(**dims), seed=seed, dtype=CHECKPOINT_DTYPE)
    fresh_dir(folder)
    with quiet_loading():
        model.save_pretrained(folder)
    figures = {
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
    }
    marker.write_text(json.dumps({"spec": wanted, "figures": figures}))
    return figures


def load_full_model(checkpoint: str | Path) -> nn.Module:
    """``from_pretrained`` of a local checkpoint: every weight on the host in fp32 (the naive
    deploy's "full precision")."""
    with quiet_loading():
        return AutoModelForCausalLM.from_pretrained(
            resolve_model_id(str(checkpoint)),
            dtype=torch.float32,
            use_safetensors=True,
            trust_remote_code=False,
        ).eval()


def compile_checkpoint(
    checkpoint: str | Path,
    folder: str | Path,
    prompt: list[int],
    max_new_tokens: int,
    shapes: Mapping | None = None,
    latency_steps: int = 12,
    warmup: int = 2,
) -> dict:
    """Load, squeeze, decode the reference, compile into ``folder``; median ms per decode step,
    exported and eager, alternated."""
    shapes = export.StepShapes(**(shapes or {}))
    model = load_full_model(checkpoint)
    int8_squeeze(model)
    export.set_traceable_experts(model)
    ids, prompt_len = torch.tensor([prompt]), len(prompt)
    reference = greedy_generate(model, ids, max_new_tokens)[0, prompt_len:].tolist()
    report = export.compile_model(
        model,
        folder,
        shapes,
        scheme=SQUEEZE,
        reference_tokens={"prompt": list(prompt), "tokens": reference},
    )
    assert (
        prompt_len <= shapes.prefill_len
        and prompt_len + latency_steps + warmup <= shapes.max_cache_len
    ), (prompt_len, shapes)
    with torch.inference_mode():
        exported = export.exported_runner(model, report.programs, shapes)
        kv = export.new_kv_cache(exported.kv_shapes, exported.dtype)
        padded = torch.full((1, shapes.prefill_len), exported.pad_token_id, dtype=torch.long)
        padded[:, :prompt_len] = ids
        logits = exported.prefill(
            exported.weights,
            kv,
            exported.embed(padded),
            torch.tensor([0]),
            torch.tensor([prompt_len - 1]),
        )
        exported_token = logits.argmax(-1, keepdim=True)
        cache = DynamicCache(config=model.config)
        eager_token = (
            model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        )
        exported_s, eager_s = [], []
        for step in range(latency_steps + warmup):
            start = time.perf_counter()
            exported_token = exported.decode(
                exported.weights,
                kv,
                exported.embed(exported_token),
                torch.tensor([prompt_len + step]),
                torch.tensor([0]),
            ).argmax(-1, keepdim=True)
            exported_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            eager_token = (
                model(input_ids=eager_token, cache=cache, use_cache=True)
                .logits[:, -1]
                .argmax(-1, keepdim=True)
            )
            eager_s.append(time.perf_counter() - start)
    exported_ms, eager_ms = (
        statistics.median(exported_s[warmup:]) * 1e3,
        statistics.median(eager_s[warmup:]) * 1e3,
    )
    return {
        **report.as_dict(),
        "exported_decode_ms": exported_ms,
        "eager_decode_ms": eager_ms,
        "exported_over_eager": exported_ms / eager_ms,
        "reference_tokens": reference,
    }


class SlimDeploy:
    """The slim deploy of an artifact folder: meta skeleton + host embedding + compiled steps."""

    def __init__(self, folder: str | Path):
        self.manifest = export.check_artifact(folder)
        self.skeleton = model_skeleton(Gemma4TextConfig.from_dict(self.manifest["config"]))
        self.host = host_embedding_for(self.skeleton, export.host_embedding_path(folder))
        self.artifact = export.load_artifact(folder)
        self.runner = self.artifact.runner(self.host)
        self.generate = self.runner.generate


class NaiveDeploy:
    """The whole model on the host in full precision, squeezed there, run eagerly."""

    def __init__(self, checkpoint: str | Path):
        self.model = load_full_model(checkpoint)
        int8_squeeze(self.model)
        self.generate = functools.partial(greedy_generate, self.model)


def run_deploy(kind: str, source: str | Path, prompt: list[int], max_new_tokens: int) -> dict:
    """Load one deploy and generate; times are seconds, ``*_epoch`` are wall-clock stamps."""
    assert kind in ("slim", "naive"), f"deploy kind {kind!r} is not one of slim, naive"
    start = time.perf_counter()
    deploy = SlimDeploy(source) if kind == "slim" else NaiveDeploy(source)
    load_s = time.perf_counter() - start
    ids = torch.tensor([prompt])
    first = deploy.generate(ids, 1)
    first_token_epoch = time.time()
    first_token_s = time.perf_counter() - start
    tokens = deploy.generate(ids, max_new_tokens)[0, len(prompt) :].tolist()
    return {
        "kind": kind,
        "load_s": load_s,
        "first_token_s": first_token_s,
        "first_token_epoch": first_token_epoch,
        "first_token": int(first[0, -1]),
        "tokens": tokens,
        "self_peak_rss_bytes": self_peak_rss_bytes(),
    }


def _measured(job: dict, interval_s: float) -> dict:
    """``main(job)`` in a fresh process under the RSS sampler: its result, peak RSS and HWM, wall
    time and RSS trace."""
    run = run_measured(
        [sys.executable, "-m", "gemma_nb.experiments.slim_deploy", json.dumps(job)],
        interval_s=interval_s,
        timeout_s=600.0,
        env={"HF_HUB_OFFLINE": "1"},
    )
    return {
        **run.result,
        "peak_rss_bytes": run.peak_rss_bytes,
        "peak_hwm_bytes": run.peak_hwm_bytes,
        "wall_s": run.wall_s,
        "rss_gb_trace": [(round(s.t_s, 3), s.rss_bytes / 1e9) for s in run.samples],
    }


def measure_deploy(
    kind: str,
    source: str | Path,
    prompt: list[int],
    max_new_tokens: int,
    interval_s: float = 0.02,
) -> dict:
    """``run_deploy`` in a fresh process under the RSS sampler; ``cold_start_s``: process start to
    first token."""
    started = time.time()
    result = _measured(
        {
            "kind": kind,
            "source": str(source),
            "prompt": list(prompt),
            "max_new_tokens": max_new_tokens,
        },
        interval_s,
    )
    result["cold_start_s"] = result.pop("first_token_epoch") - started
    return result


def measure_compile(
    checkpoint: str | Path, folder: str | Path, prompt: list[int], max_new_tokens: int
) -> dict:
    """``compile_checkpoint`` in a fresh process under the sampler (the compile-side budget)."""
    return _measured(
        {
            "kind": "compile",
            "source": str(checkpoint),
            "folder": str(folder),
            "prompt": list(prompt),
            "max_new_tokens": max_new_tokens,
        },
        interval_s=0.05,
    )


def comparison_table(slim: dict, naive: dict, reference: list[int]):
    """Slim and naive side by side: peak RSS, load, first token, cold start, tokens == reference."""
    rows = [
        {
            "deploy": r["kind"],
            "peak_rss_gb": r["peak_rss_bytes"] / 1e9,
            "load_s": r["load_s"],
            "first_token_s": r["first_token_s"],
            "cold_start_s": r["cold_start_s"],
            "tokens_match_reference": r["tokens"] == reference,
        }
        for r in (slim, naive)
    ]
    return pd.DataFrame(rows).set_index("deploy")


def performance_targets(slim: dict, naive: dict, compiled: dict) -> list[dict]:
    """The two ratios as headline rows held to their targets: slim/naive peak RSS, exported/eager
    decode step."""
    rss = slim["peak_rss_bytes"] / naive["peak_rss_bytes"]
    step = compiled["exported_over_eager"]
    return [
        headline("slim / naive deploy peak host RSS", rss, "x", at_most=SLIM_RSS_TARGET),
        headline("exported / eager decode step", step, "x", at_most=DECODE_LATENCY_TARGET),
    ]


def host_budget_26b(config) -> dict:
    """GB on the host for a model of ``config``: naive, the bf16 checkpoint and fp32 model; slim,
    the bf16 table."""
    params = memory.param_summary(config)["total_params"]
    return {
        "naive: model in fp32": 4 * params / 1e9,
        "naive: checkpoint in bf16": 2 * params / 1e9,
        "slim: host embedding (bf16)": 2 * config.vocab_size * config.hidden_size / 1e9,
    }


def plot_rss_traces(results: Mapping[str, dict], ax) -> None:
    """RSS over time of each measured deploy process, its peak marked."""
    for name, result in results.items():
        times, rss = zip(*result["rss_gb_trace"])
        lines = ax.plot(times, rss, label=f"{name}: peak {result['peak_rss_bytes'] / 1e9:.2f} GB")
        ax.axhline(
            result["peak_rss_bytes"] / 1e9, color=lines[0].get_color(), linestyle=":", linewidth=1
        )
    ax.set(xlabel="seconds since the process started", ylabel="host RSS (GB)")
    ax.legend(loc="upper left", fontsize=9)


def plot_host_budget(
    budget: Mapping[str, float], ax, host_ram_gb: float, story_peak_gb: float
) -> None:
    """Bars of ``host_budget_26b`` on a log axis, with the host's RAM and the story's deploy peak
    as lines named beside them in the top bar's row (the slim bar ends far left of both)."""
    ax.barh(
        list(budget),
        list(budget.values()),
        color=["C1" if n.startswith("naive") else "C0" for n in budget],
    )
    ax.set(xscale="log", xlim=(0.5, max(budget.values()) * 2), xlabel="GB on the host (log scale)")
    top_row = len(budget) - 1
    for value, label, color, side in (
        (story_peak_gb, f"story's deploy RSS peak ({story_peak_gb:.0f} GB)", "C3", -1),
        (host_ram_gb, f"inf2.xlarge host RAM ({host_ram_gb:.1f} GB)", "0.25", 1),
    ):
        ax.axvline(value, color=color, linestyle="--", linewidth=1.2)
        align = "left" if side > 0 else "right"
        # a few percent beside the line: the axis is logarithmic
        ax.text(value * 1.05**side, top_row, label, ha=align, va="center", size=9, color=color)


def main(argv: list[str]) -> None:
    job = json.loads(argv[0])
    if job["kind"] == "compile":
        result = compile_checkpoint(
            job["source"], job["folder"], job["prompt"], job["max_new_tokens"]
        )
        result["self_peak_rss_bytes"] = self_peak_rss_bytes()
    else:
        result = run_deploy(job["kind"], job["source"], job["prompt"], job["max_new_tokens"])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_grad_enabled(False)
    main(sys.argv[1:])
