"""Notebook 02 (quantization): each scheme scored by the KL divergence of its next-token
distribution from the unquantized model's, top-1 agreement and perplexity, teacher-forced on
held-out text; the evaluation's host peak and time scaled to the 26B; formats and Pareto plot."""

import math
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch
import torch.nn.functional as F

from gemma_nb import evaluate, formats, memory, plots, quant
from gemma_nb.bench import check_counts, time_steps
from gemma_nb.hardware import GB, GiB
from gemma_nb.modelio import load_model, resolve_model_id
from gemma_nb.neuron.checkpoint import text_config
from gemma_nb.peak_rss import HostMemorySampler
from gemma_nb.targets import one_thread
from gemma_nb.tiny.corpus import HELD_OUT

HELD_OUT_TEXT = "held-out"  # eval_text naming the bundled corpus's held-out split
# The head's share of the error, on its own: the int8 lm_head (rest bf16), replicated and sharded.
_INT8_HEAD = memory.Scheme("int8_lm_head", "int8 lm_head, rest bf16", {"lm_head": "int8"})
HEAD_ALONE = (_INT8_HEAD, replace(_INT8_HEAD, name="int8_lm_head_sharded", lm_head_sharded=True))
REFERENCE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Bytes per logit of the sequence scored: bf16 and fp32 logits, log-softmax, 3 temporaries.
TRANSIENT_BYTES_PER_LOGIT = 2 + 4 * 5


def eval_batches(tokenizer, eval_text: str, eval_tokens: int, chunk_tokens: int):
    """Token batches ``[B, S]`` of the held-out text: the corpus's held-out split, by length, or a
    text file's first ``eval_tokens`` tokens in sequences of ``chunk_tokens``."""
    check_counts(eval_tokens=eval_tokens, chunk_tokens=chunk_tokens)
    if not 2 <= chunk_tokens <= eval_tokens:
        raise ValueError(
            f"chunk_tokens={chunk_tokens} must be >= 2 and <= eval_tokens={eval_tokens}"
        )
    if eval_text == HELD_OUT_TEXT:
        return evaluate.prompt_batches(tokenizer, [fact.sentence for fact in HELD_OUT])
    path = Path(str(eval_text)).expanduser()
    if not path.is_file():
        raise ValueError(
            f"eval_text {eval_text!r} is not a file: pass {HELD_OUT_TEXT!r} (the bundled corpus's "
            "held-out split) or a UTF-8 text file, such as wikitext-2's test split "
            "wikitext-2-raw/wiki.test.raw (docs/inf2.md downloads it)"
        )
    return evaluate.text_batches(
        tokenizer, path.read_text(encoding="utf-8"), chunk_tokens, eval_tokens
    )


class Evaluation(NamedTuple):
    """What :func:`evaluate_held_out` measured: scores per compute dtype, positions, and so on."""

    scores: dict
    positions: int
    config: object
    host: dict
    seconds: float


def evaluate_held_out(model_id, schemes: dict, batches_fn, tp: int, device: str = "cpu"):
    """Each scheme applied in place to ``model_id`` loaded afresh in bf16 (its safetensors
    memory-mapped), scored on ``batches_fn(tokenizer)`` against the bf16 model and, where the
    checkpoint stores fp32, the fp32 one; then in fp32 compute too. Host RSS sampled throughout."""
    config = text_config(resolve_model_id(model_id))
    computes = list(REFERENCE_DTYPES.items())[: 1 + (config.dtype == torch.float32)]
    references, scores = {}, {}
    with HostMemorySampler() as sampler:
        for name, dtype in computes:
            model, tokenizer = load_model(model_id, dtype=dtype, device=device)
            batches = batches_fn(tokenizer)
            references[name] = [evaluate.next_token_logprobs(model, ids) for ids in batches]
            del model
        for name, dtype in computes:
            refs = references if name == "bf16" else {name: references[name]}
            scores[name] = score_schemes(model_id, dtype, refs, batches, schemes, tp, device)
    host = {
        "baseline_bytes": sampler.samples[0].rss_bytes,
        "peak_bytes": sampler.peak_rss_bytes,
        "longest_sequence": max(ids.shape[1] for ids in batches) - 1,
    }
    positions = sum(ids[:, 1:].numel() for ids in batches)
    return Evaluation(scores, positions, config, host, sampler.wall_s)


@torch.no_grad()
def score_schemes(model_id, dtype, references: dict, batches, schemes: dict, tp: int, device):
    """Per scheme, on ``model_id`` loaded in ``dtype`` and quantized in place: KL mean and p99 and
    top-1 agreement against each reference's log-probabilities (one tensor per batch), and
    perplexity."""
    rows = {}
    for name, scheme in schemes.items():
        model = load_model(model_id, dtype=dtype, device=device)[0]
        quant.apply_scheme(model, scheme, tp=tp)
        scores = {ref: [] for ref in references}
        for i, ids in enumerate(batches):
            logp = evaluate.next_token_logprobs(model, ids)
            for ref, ref_logps in references.items():
                scores[ref].append(evaluate.position_scores(ref_logps[i], logp, ids[:, 1:]))
        del model
        rows[name] = {}
        for ref, per_batch in scores.items():
            summary = evaluate.shift_summary(per_batch)
            rows[name]["perplexity"] = summary.pop("perplexity")
            rows[name] |= {f"{key}_vs_{ref}": value for key, value in summary.items()}
    return pd.DataFrame(rows).T.rename_axis("scheme")


def host_needs(config, schemes: dict, positions: int, sequence: int) -> dict:
    """Host bytes of the evaluation of a ``config`` model checkpointed in ``config.dtype``, from the
    planner: the checkpoint mmapped, its bf16 copy (none from a bf16 one), the largest quantized
    copy a scheme adds, the references' log-probabilities, one ``sequence``'s transient logits."""
    params = memory.param_summary(config)["total_params"]
    stored = config.dtype or torch.bfloat16  # a config without one: the 26B's, bf16 on the hub

    def quantized_bytes(scheme) -> int:  # the groups it quantizes, whole
        return sum(memory.plan(config, 1, scheme).bytes(g) for g in quant.resolve_scheme(scheme))

    references = 1 + (stored == torch.float32)
    return {
        "checkpoint_mmapped": params * stored.itemsize,
        "bf16_copy": 0 if stored == torch.bfloat16 else 2 * params,
        "quantized_copy": max(quantized_bytes(scheme) for scheme in schemes.values()),
        "reference_logprobs": 4 * references * positions * config.vocab_size,
        "sequence_logits": TRANSIENT_BYTES_PER_LOGIT * sequence * config.vocab_size,
    }


def host_peak_table(evaluation: Evaluation, config_26b, schemes, eval_tokens, chunk_tokens):
    """The evaluation's host bytes by component, here (modelled, then measured) and for the 26B in
    bf16 on ``eval_tokens`` of text in ``chunk_tokens`` sequences: the planner's components plus
    what the measurement holds beyond its own (never scaled), plus the baseline."""
    host = evaluation.host
    here = host_needs(evaluation.config, schemes, evaluation.positions, host["longest_sequence"])
    sequences = eval_tokens // chunk_tokens
    big = host_needs(config_26b, schemes, sequences * (chunk_tokens - 1), chunk_tokens - 1)
    measured = host["peak_bytes"] - host["baseline_bytes"]
    rest = max(0, measured - sum(here.values()))
    table = pd.DataFrame({"bundled_gb": here, "model_26b_gb": big}) / GB
    table.loc["beyond_the_components"] = (rest / GB, rest / GB)
    table.loc["process_baseline"] = (host["baseline_bytes"] / GB,) * 2
    table.loc["total"] = table.sum()
    table.loc["measured_peak", "bundled_gb"] = host["peak_bytes"] / GB
    return table.rename_axis("host_memory")


def time_estimate(config, schemes, seconds, flops_per_s, eval_tokens, chunk_tokens, instance):
    """Hours and USD on ``instance`` of the evaluation of a ``config`` model: the forward FLOPs of a
    reference pass and a pass per scheme at ``flops_per_s`` (one thread here), each scheme's
    quantization and its dequantization per sequence at the full-size layer's ``seconds`` per
    format, scaled by parameters; at one thread, and with all but the quantizer (one thread)
    spread over the instance's vCPUs, a lower bound."""
    summary = memory.param_summary(config)
    layer_params = summary["experts_params"] / config.num_hidden_layers
    head_params = config.vocab_size * config.hidden_size
    sequences = eval_tokens // chunk_tokens
    per_token = 2 * (summary["active_params_excl_embeddings"] + head_params)
    forward = (1 + len(schemes)) * sequences * chunk_tokens * per_token / flops_per_s
    quantize = dequantize = 0.0
    for scheme in schemes.values():
        for group, fmt in quant.resolve_scheme(scheme).items():
            params = head_params if group == "lm_head" else summary[f"{group}_params"]
            quantize += params / layer_params * seconds.loc[fmt, "quantize_s"]
            dequantize += params / layer_params * seconds.loc[fmt, "dequantize_s"] * sequences
    spread = quantize + (forward + dequantize) / instance.vcpus
    hours = (
        pd.Series(
            {"one thread": forward + quantize + dequantize, f"{instance.vcpus} vCPUs": spread}
        )
        / 3600
    )
    return pd.DataFrame({"hours": hours, "usd": hours * instance.usd_per_hour}).rename_axis("cpus")


def bf16_matmul_flops_per_s(config, tokens: int) -> float:
    """FLOP/s of one thread on a bf16 matmul of a sequence, ``[tokens, hidden]`` by an expert's
    ``gate_up``: the median of three steps."""
    generator = torch.Generator().manual_seed(0)
    shape = (2 * config.moe_intermediate_size, config.hidden_size)
    x, weight = (
        torch.randn(*s, generator=generator).bfloat16() for s in ((tokens, shape[1]), shape)
    )
    with one_thread():
        steps = time_steps({"matmul": lambda _: F.linear(x, weight)}, 3, repeats=1)
    return 2 * tokens * weight.numel() / (steps.p50_ms("matmul") / 1000)


def formats_table(shape=(1408, 2816)):
    """bf16 and the quantized formats side by side (``formats.FORMATS``' fields), with bytes per
    weight of a ``shape`` matrix (default: a 26B expert's gate_up)."""
    rows = [
        f._asdict() | {"bytes_per_weight": memory.tensor_bytes(shape, f.name) / math.prod(shape)}
        for f in (formats.FORMATS["bf16"], *formats.QUANTIZED_FORMATS.values())
    ]
    table = pd.DataFrame(rows).rename(columns={"name": "format", "block_size": "block"})
    scale = table["scale_dtype"].map(str).str.removeprefix("torch.").replace("None", "none")
    table = table.assign(scale_dtype=scale, description=table.pop("description"))
    return table.astype({"block": "Int64"})


# Each compute dtype's panel: the KL column it plots, the y label and the title.
PANELS = {
    "bf16": ("kld_mean_vs_bf16", "KL from the bf16 model (nats)", "as the port runs it: bf16"),
    "fp32": ("kld_mean_vs_fp32", "KL from the fp32 model (nats)", "the quantization alone: fp32"),
}


def pareto_figure(scores: dict, gb_per_rank, tp: int):
    """A panel per compute dtype of ``scores``: each scheme's mean KL against the 26B's GB per rank
    (log y), the 16 GiB line and the Pareto front of the schemes within it; one legend below, so no
    label can land on a point whatever the values."""
    fig, axes = plots.subplots(1, len(scores), figsize=(10, 5.4), squeeze=False)
    budget = 16 * GiB / GB
    names = list(next(iter(scores.values())).index)
    colors = plots.sns.color_palette("colorblind", len(names))
    rounding = scores["bf16"].get("kld_mean_vs_fp32", {}).get("bf16")  # bf16 against fp32
    for ax, (compute, table) in zip(axes[0], scores.items()):
        column, ylabel, title = PANELS[compute]
        points = pd.DataFrame({"x": gb_per_rank.reindex(names), "y": table[column].astype(float)})
        points = points[points["y"] > 0]  # the reference itself has no place on a log axis
        fits = points[points["x"] <= budget].sort_values(["x", "y"])
        front = fits[fits["y"] == fits["y"].cummin()]
        _ = ax.plot(
            front["x"], front["y"], color="0.6", zorder=1, label="Pareto front of what fits"
        )
        for i, name in enumerate(names):
            if name in points.index:
                x, y = points.loc[name]
                _ = ax.scatter(x, y, color=colors[i], marker="osD^vP*Xhp"[i % 10], label=name)
        _ = ax.axvline(budget, color="0.25", linestyle="--", linewidth=1.2, label="16 GiB per core")
        if rounding is not None:
            _ = ax.axhline(rounding, color="0.25", linestyle=":", label="bf16 model against fp32")
        ax.margins(x=0.15, y=0.15)
        xlabel = f"26B bytes per rank at TP={tp} (GB, planner)"
        ax.set(yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    _ = fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8)
    return fig


def planner_check(full_size, plans, num_layers: int, tp: int):
    """Per format: one full-size layer's stored bytes times ``num_layers`` over ``tp``, against the
    planner's experts per rank."""
    layers = full_size[full_size["tensor"] == "layer"].set_index("format")["stored_bytes"]
    rows = [
        {
            "format": fmt,
            "stored_per_layer_bytes": int(stored),
            "whole_model_per_rank_bytes": int(stored) * num_layers // tp,
            "planner_per_rank_bytes": plans[f"{fmt}_experts"].bytes("experts"),
        }
        for fmt, stored in layers.items()
    ]
    return pd.DataFrame(rows).assign(
        equal=lambda t: t["whole_model_per_rank_bytes"] == t["planner_per_rank_bytes"]
    )
