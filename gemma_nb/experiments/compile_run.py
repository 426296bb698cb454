"""What compiling costs, measured (notebook 04): the size sweep, its growth fits, plots and boxes,
exported-vs-eager decoding. ``python -m gemma_nb.experiments.compile_run '{"dims": ..., "folder":
...}'`` compiles one point, prints JSON last on stdout."""

import json
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import psutil
import torch
from torch import nn
from transformers import GenerationConfig
from transformers.integrations.executorch import (
    TorchExportableModuleWithStaticCache,
    convert_and_export_with_cache,
)

from gemma_nb.evaluate import greedy_generate
from gemma_nb.export import (
    StepRunner,
    StepShapes,
    compile_model,
    export_steps,
    exported_runner,
    set_traceable_experts,
)
from gemma_nb.hardware import GB, INSTANCES
from gemma_nb.peak_rss import run_measured, self_peak_rss_bytes
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model

# Random-weight Gemma-4 configs of growing size for notebook 04 (the 26B's architecture, scaled):
# four widths at two layers (parameters grow ~70x) and the smallest width at 6 layers (the graph
# grows, the parameters barely), so time can be split into a per-layer and a per-byte part.
_SWEEP_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "num_global_key_value_heads",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
    "vocab_size",
    "num_hidden_layers",
)
SWEEP_POINTS: dict[str, dict] = {
    name: dict(zip(_SWEEP_FIELDS, values))
    for name, values in {
        "w256_l2": (256, 384, 4, 2, 64, 128, 1, 16, 2, 128, 8192, 2),
        "w256_l6": (256, 384, 4, 2, 64, 128, 1, 16, 2, 128, 8192, 6),
        "w1024_l2": (1024, 1152, 8, 4, 128, 256, 2, 64, 4, 384, 32768, 2),
        "w1536_l2": (1536, 1536, 16, 8, 128, 256, 2, 96, 8, 512, 32768, 2),
        "w512_l2": (512, 768, 8, 4, 64, 128, 1, 32, 4, 256, 16384, 2),
    }.items()
}


def compile_sweep(points: Mapping[str, Mapping], folder: str | Path):
    """One row per config of ``points``, compiled by ``main`` in a fresh Python under the RSS
    sampler, artifact deleted."""
    rows = []
    for name, dims in points.items():
        target = Path(folder) / name
        job = {"dims": dict(dims), "folder": str(target)}
        run = run_measured(
            [sys.executable, "-m", "gemma_nb.experiments.compile_run", json.dumps(job)],
            interval_s=0.05,
            timeout_s=300.0,
            env={"HF_HUB_OFFLINE": "1"},
        )
        result = {
            **run.result,
            "peak_rss_bytes": run.peak_rss_bytes,
            "peak_hwm_bytes": run.peak_hwm_bytes,
        }
        shutil.rmtree(target, ignore_errors=True)
        rows.append(
            {
                "point": name,
                "params": result["params"],
                "layers": result["layers"],
                **{
                    f"{key}_gb": result[f"{key}_bytes"] / 1e9
                    for key in ("weight", "held_rss", "peak_rss", "peak_hwm")
                },
                "export_s": result["export_s"],
                "save_s": result["save_s"],
                "compile_s": result["export_s"] + result["save_s"],
                "build_s": result["build_s"],
                "wall_s": run.wall_s,
            }
        )
    return pd.DataFrame(rows).set_index("point")


def fit_linear(features: Mapping[str, object], y) -> dict:
    """Least-squares ``y = intercept + sum_k coef_k * features[k]``; returns the coefficients and
    r^2."""
    names = list(features)
    y = np.asarray(y, dtype=float)
    design = np.stack(
        [np.ones_like(y)] + [np.asarray(features[n], dtype=float) for n in names], axis=1
    )
    if design.shape[0] < design.shape[1]:
        raise ValueError(
            f"need at least {design.shape[1]} points to fit {', '.join(names)} and an intercept, "
            f"got {design.shape[0]}"
        )
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ coef
    total = ((y - y.mean()) ** 2).sum()
    return {
        "intercept": float(coef[0]),
        **{n: float(c) for n, c in zip(names, coef[1:])},
        "r2": float(1.0 - (residual**2).sum() / total) if total > 0 else 1.0,
    }


def growth_fits(sweep) -> dict:
    """Peak RSS (GB) linear in parameters; compile seconds linear in layers (graph export) and
    weight GB (writing)."""
    return {
        "rss": fit_linear({"slope": sweep["params"]}, sweep["peak_rss_gb"]),
        "time": fit_linear(
            {"layers": sweep["layers"], "weight_gb": sweep["weight_gb"]}, sweep["compile_s"]
        ),
    }


def fits_table(fits: Mapping):
    """The two growth laws as readable rows, coefficients in their units."""
    rss, cost = fits["rss"], fits["time"]
    return pd.DataFrame(
        [
            {
                "law": "peak RSS (GB) = a + b x params",
                "a": rss["intercept"],
                "b": rss["slope"] * 1e9,
                "b unit": "bytes per parameter",
                "c": None,
                "c unit": "",
                "r2": rss["r2"],
            },
            {
                "law": "compile (s) = a + b x layers + c x weight GB",
                "a": cost["intercept"],
                "b": cost["layers"],
                "b unit": "s per layer",
                "c": cost["weight_gb"],
                "c unit": "s per GB",
                "r2": cost["r2"],
            },
        ]
    ).set_index("law")


def extrapolate(fits: Mapping, params: int, layers: int, weight_gb: float) -> dict:
    """Both fits evaluated at a model of ``params`` parameters, ``layers`` layers, ``weight_gb``
    GB."""
    rss, cost = fits["rss"], fits["time"]
    seconds = cost["intercept"] + cost["layers"] * layers + cost["weight_gb"] * weight_gb
    return {
        "peak_rss_gb": rss["intercept"] + rss["slope"] * params,
        "compile_s": seconds,
        "compile_min": seconds / 60,
        "rss_bytes_per_param": rss["slope"] * 1e9,
    }


def plot_growth(sweep, fits: Mapping, ax_rss, ax_time) -> None:
    """Peak RSS and compile time vs parameters (millions), measured and fitted (time: per layer
    count, bf16 weights)."""
    params = np.linspace(0, sweep["params"].max() * 1.05, 50)
    rss, cost = fits["rss"], fits["time"]
    for layers, group in sweep.groupby("layers"):
        points = ax_rss.scatter(
            group["params"] / 1e6, group["peak_rss_gb"], label=f"{layers} layers", zorder=3
        )
        ax_time.scatter(
            group["params"] / 1e6, group["compile_s"], label=f"{layers} layers", zorder=3
        )
        seconds = cost["intercept"] + cost["layers"] * layers + cost["weight_gb"] * 2 * params / 1e9
        ax_time.plot(params / 1e6, seconds, color=points.get_facecolor()[0], linewidth=1)
    ax_rss.plot(
        params / 1e6,
        rss["intercept"] + rss["slope"] * params,
        color="0.4",
        label=f"fit: {rss['intercept']:.2f} GB + {rss['slope'] * 1e9:.2f} bytes/param",
    )
    for ax, label, top in (
        (ax_rss, "peak host RSS (GB)", sweep["peak_rss_gb"].max()),
        (ax_time, "export + save (s)", sweep["compile_s"].max()),
    ):
        # room above the data for the legend
        ax.set(xlabel="parameters (millions)", ylabel=label, ylim=(0, 1.8 * top))
        ax.legend(loc="upper left", fontsize=9)


def greedy_equality(
    reference: nn.Module, runner: StepRunner, tokenizer, prompts, max_new_tokens: int
):
    """Per prompt: eager greedy continuation vs the two-step runner's; tokens equal or not."""
    rows = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        eager = greedy_generate(reference, ids, max_new_tokens)[0, ids.shape[1] :].tolist()
        exported = runner.generate(ids, max_new_tokens)[0, ids.shape[1] :].tolist()
        rows.append(
            {
                "prompt": prompt,
                "continuation": tokenizer.decode(exported[:8]),
                "tokens_equal": f"{sum(a == b for a, b in zip(eager, exported))}/{len(eager)}",
                "match": eager == exported,
            }
        )
    return pd.DataFrame(rows)


def compile_box_table(
    peak_host_gb: Mapping[str, float], compile_hours: Mapping[str, float], swap_gb: float = 100.0
):
    """Per inf2 instance: holds each peak host GB (label -> GB), with and without swap; $ of each
    compile (label -> hours)."""
    rows = []
    for inst in INSTANCES.values():
        row = {
            "instance": inst.name,
            "host_ram_gb": inst.host_ram_bytes / GB,
            "usd_per_hour": inst.usd_per_hour,
        }
        for label, peak in peak_host_gb.items():
            row[f"holds {label}"] = inst.host_ram_bytes / GB >= peak
            row[f"holds {label} + {swap_gb:.0f} GB swap"] = (
                inst.host_ram_bytes / GB + swap_gb >= peak
            )
        row.update(
            {f"usd {label}": inst.usd_per_hour * hours for label, hours in compile_hours.items()}
        )
        rows.append(row)
    return pd.DataFrame(rows).set_index("instance")


def transformers_recipe_tokens(
    model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, max_cache_len: int
) -> list[int]:
    """New tokens from transformers' export recipe and its ``generate`` (which feeds each token one
    position too far)."""
    set_traceable_experts(model)
    saved = model.generation_config
    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        cache_config={"batch_size": 1, "max_cache_len": max_cache_len},
    )
    try:
        program = convert_and_export_with_cache(model, strict=False)
    finally:
        model.generation_config = saved
    module = program.module()  # unlifted once, not per token as transformers' generate would
    unlifted = SimpleNamespace(module=lambda: module, named_buffers=program.named_buffers)
    return TorchExportableModuleWithStaticCache.generate(unlifted, input_ids, max_new_tokens)[
        0, input_ids.shape[1] :
    ].tolist()


def off_by_one_table(
    models: Mapping[str, nn.Module],
    input_ids: torch.Tensor,
    max_new_tokens: int,
    runners: Mapping[str, StepRunner] | None = None,
):
    """Per model: greedy tokens equal to eager from transformers' recipe and from ``export_steps``
    (``runners``: exported)."""
    prompt = input_ids.shape[1]
    shapes = StepShapes(max_cache_len=prompt + max_new_tokens, prefill_len=prompt)
    rows = []
    for name, model in models.items():
        eager = greedy_generate(model, input_ids, max_new_tokens)[0, prompt:].tolist()
        recipe = transformers_recipe_tokens(model, input_ids, max_new_tokens, shapes.max_cache_len)
        runner = (runners or {}).get(name) or exported_runner(
            model, export_steps(model, shapes), shapes
        )
        ours = runner.generate(input_ids, max_new_tokens)[0, prompt:].tolist()
        for loop, tokens in (
            ("transformers recipe + its generate", recipe),
            ("gemma_nb export_steps + StepRunner", ours),
        ):
            rows.append(
                {
                    "model": name,
                    "loop": loop,
                    "tokens_equal_to_eager": sum(a == b for a, b in zip(eager, tokens)),
                    "of": len(eager),
                }
            )
    return pd.DataFrame(rows)


def main(argv: list[str]) -> None:
    job = json.loads(argv[0])
    start = time.perf_counter()
    model = random_gemma4_model(random_gemma4_config(**job["dims"]), seed=0, dtype=torch.bfloat16)
    build_s = time.perf_counter() - start
    held = psutil.Process().memory_info().rss
    report = compile_model(model, job["folder"], StepShapes(**(job.get("shapes") or {})))
    print(
        json.dumps(
            {
                "layers": model.config.num_hidden_layers,
                "build_s": build_s,
                "held_rss_bytes": held,
                "weight_bytes": sum(t.nbytes for t in model.parameters()),
                **report.as_dict(),
                "self_peak_rss_bytes": self_peak_rss_bytes(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
