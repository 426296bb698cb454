"""Notebook 02 (quantization): what a ``gemma_nb.quant`` scheme costs in answers, scored against the
float model (logit agreement, KL, fact recall, greedy tokens), and the formats, the head alone and
the Pareto plot."""

import copy
import math

import pandas as pd
import torch
from torch import nn

from gemma_nb import evaluate, memory, quant
from gemma_nb.tiny import FACTS


@torch.no_grad()
def greedy_tokens(model, tokenizer, prompts, steps: int) -> list[list[int]]:
    """``steps`` greedy new tokens per prompt, batched by prompt length as ``evaluate.fact_recall``
    decodes (eos-padded)."""
    token_lists = [tokenizer(p).input_ids for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for indices, batch in evaluate.length_batches(token_lists):
        generated = evaluate.greedy_generate(
            model, batch, steps, eos_token_id=tokenizer.eos_token_id
        )[:, batch.shape[1] :]
        for i, row in zip(indices, generated.tolist()):
            out[i] = row + [tokenizer.eos_token_id] * (steps - len(row))
    return out


def greedy_table(prompts, reference_tokens, candidate_tokens, tokenizer):
    """Per prompt: ``match`` (all tokens equal), ``first_divergent_step`` (or None) and both
    texts."""
    firsts = [
        next((i for i, (r, c) in enumerate(zip(ref, cand)) if r != c), None)
        for ref, cand in zip(reference_tokens, candidate_tokens)
    ]
    rows = [
        (prompt, first is None, first, tokenizer.decode(ref), tokenizer.decode(cand))
        for prompt, ref, cand, first in zip(prompts, reference_tokens, candidate_tokens, firsts)
    ]
    table = pd.DataFrame(
        rows, columns=["prompt", "match", "first_divergent_step", "reference", "candidate"]
    )
    return table.astype({"first_divergent_step": "Int64"})


@torch.no_grad()
def divergence_detail(
    reference, candidate, tokenizer, prompt: str, reference_tokens: list[int], step: int, k: int = 3
):
    """Both models' top-``k`` next tokens after the prompt and the reference's first ``step``
    tokens."""
    ids = torch.tensor([tokenizer(prompt).input_ids + reference_tokens[:step]])
    rows = []
    for label, model in (("reference", reference), ("candidate", candidate)):
        values, indices = model(input_ids=ids).logits[0, -1].float().topk(k)
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist())):
            rows.append(
                {
                    "model": label,
                    "rank": rank + 1,
                    "token": tokenizer.decode([index]),
                    "logit": value,
                    "gap_to_top": values[0].item() - value,
                }
            )
    return pd.DataFrame(rows)


def evaluate_scheme(
    reference,
    tokenizer,
    scheme,
    dtype: torch.dtype = torch.bfloat16,
    facts=FACTS,
    reference_greedy: list[list[int]] | None = None,
    steps: int = 4,
    device: str = "cpu",
    answers: bool = True,
):
    """``(model, summary, report, greedy)`` of ``scheme`` on a ``dtype`` copy of ``reference`` (a
    model or its ``CachedLogits``): logit scores on the facts' sentences; fact recall and greedy
    match against ``reference_greedy`` if ``answers``."""
    prompts = [f.prompt for f in facts]
    model = copy.deepcopy(
        reference.model if isinstance(reference, evaluate.CachedLogits) else reference
    ).to(dtype)
    report = quant.apply_scheme(model, scheme)
    model = model.to(device).eval()
    logits = evaluate.compare_logits(
        reference, model, [f.sentence for f in facts], tokenizer=tokenizer
    )
    summary = {
        "top1_agreement": logits["top1_agreement"],
        "kl_mean": logits["kl_mean"],
        "max_abs_diff": logits["max_abs_diff"],
        "fact_recall": None,
        "greedy_match": None,
        "quantized_bytes": int(report["stored_bytes"].sum()),
        "quantized_bf16_bytes": int(report["bf16_bytes"].sum()),
    }
    greedy = None
    if answers:
        longest_answer = max(
            len(tokenizer(f.answer, add_special_tokens=False).input_ids) for f in facts
        )
        tokens = greedy_tokens(model, tokenizer, prompts, max(steps, longest_answer))
        greedy = greedy_table(prompts, reference_greedy, [t[:steps] for t in tokens], tokenizer)
        summary["fact_recall"] = evaluate.recall_from_tokens(tokenizer, facts, tokens)[0]
        summary["greedy_match"] = float(greedy["match"].mean())
    return model, summary, report, greedy


def formats_table(shape=(1408, 2816)):
    """The formats side by side, with bytes per weight of a ``shape`` matrix (default: a 26B
    expert's gate_up)."""
    rows = [
        {
            "format": "bf16",
            "element_bits": 16,
            "block": None,
            "scale": "none",
            "per_tensor_scale": False,
            "bytes_per_weight": memory.tensor_bytes(shape, "bf16") / math.prod(shape),
            "description": "bfloat16",
        }
    ]
    for f in quant.FORMATS.values():
        per = "row" if f.block_size is None else f"{f.block_size} inputs"
        rows.append(
            {
                "format": f.name,
                "element_bits": f.element_bits,
                "block": f.block_size,
                "scale": f"{str(f.scale_dtype).replace('torch.', '')} per {per}",
                "per_tensor_scale": f.per_tensor_scale,
                "bytes_per_weight": memory.tensor_bytes(shape, f.name) / math.prod(shape),
                "description": f.description,
            }
        )
    return pd.DataFrame(rows).astype({"block": "Int64"})


@torch.no_grad()
def lm_head_isolation(model, tokenizer, fmt: str = "int8", texts=None) -> dict:
    """The float head vs a ``fmt`` copy on the model's own final hidden states (softcap left out: it
    keeps the order); ``near_ties``: positions whose top-1 - top-2 margin is under twice the max
    logit error, the only ones it could flip."""
    head = model.get_output_embeddings()
    assert isinstance(head, nn.Linear), (
        f"model.lm_head is {type(head).__name__}: pass the float model"
    )
    batches = evaluate.prompt_batches(tokenizer, texts)
    # the head's input
    hidden = torch.cat(
        [model.model(input_ids=ids).last_hidden_state.flatten(0, 1) for ids in batches]
    )
    exact = torch.nn.functional.linear(hidden, head.weight).float()
    quantized = quant.quantized_linear(head.weight.detach(), fmt, "lm_head.weight")(hidden).float()
    top2 = exact.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    max_error = float((quantized - exact).abs().max())
    return {
        "positions": int(hidden.shape[0]),
        "top1_agreement": float((exact.argmax(-1) == quantized.argmax(-1)).float().mean()),
        "max_abs_logit_error": max_error,
        "margin_min": float(margin.min()),
        "margin_median": float(margin.median()),
        "near_ties": int((margin < 2 * max_error).sum()),
    }


def score_schemes(reference, tokenizer, schemes, reference_greedy, steps: int, device: str = "cpu"):
    """:func:`evaluate_scheme` per scheme in bf16, its logit scores also in fp32: ``(results,
    models, reports, greedy)``."""
    reference = evaluate.CachedLogits(reference)
    models, reports, greedy, rows = {}, {}, {}, {}
    for name in schemes:
        key = str(name)
        models[key], summary, reports[key], greedy[key] = evaluate_scheme(
            reference,
            tokenizer,
            name,
            dtype=torch.bfloat16,
            reference_greedy=reference_greedy,
            steps=steps,
            device=device,
        )
        fp32 = evaluate_scheme(
            reference,
            tokenizer,
            name,
            dtype=torch.float32,
            steps=steps,
            device=device,
            answers=False,
        )[1]
        rows[key] = {
            **summary,
            **{f"{score}_float32": fp32[score] for score in ("top1_agreement", "kl_mean")},
        }
    return pd.DataFrame(rows).T.rename_axis("scheme"), models, reports, greedy


def score_findings(results, weight_errors, reference_recall: float) -> dict:
    """What the :func:`score_schemes` tables say (KL orders and added KLs in fp32 compute), for the
    notebook's sentences."""
    kept = results.index[
        (results["fact_recall"] == reference_recall) & (results["greedy_match"] == 1.0)
    ]
    quantized = results.drop(index="bf16")
    top1_delta = quantized["top1_agreement"] - results.loc["bf16", "top1_agreement"]
    experts_only = [s for s in quantized.index if set(quant.resolve_scheme(s)) == {"experts"}]
    expert_errors = weight_errors[weight_errors["group"] == "experts"].set_index("scheme")[
        "rel_error"
    ]
    experts_by_kl = list(quantized.loc[experts_only, "kl_mean_float32"].sort_values().index)
    experts_by_error = list(expert_errors.loc[experts_only].sort_values().index)
    kl = results["kl_mean_float32"]
    has = set(results.index).issuperset
    return {
        "kept": list(kept),
        "changed": [s for s in results.index if s not in kept],
        "bf16_disagreement": 1.0 - float(results.loc["bf16", "top1_agreement"]),
        "top1_spread": float(top1_delta.abs().max()),
        "top1_both_sides": bool((top1_delta > 0).any() and (top1_delta < 0).any()),
        "kl_order": list(quantized["kl_mean_float32"].sort_values().index),
        "experts_by_kl": experts_by_kl,
        "experts_by_weight_error": experts_by_error,
        "follows_weight_error": experts_by_kl == experts_by_error,
        "shared_mlp_kl_added": float(kl["int8_experts_shared_mlp"] - kl["int8_experts"])
        if has({"int8_experts", "int8_experts_shared_mlp"})
        else None,
        "lm_head_kl_added": float(kl["int8_squeeze"] - kl["int8_experts_shared_mlp"])
        if has({"int8_experts_shared_mlp", "int8_squeeze"})
        else None,
    }


def plot_pareto(
    results,
    x: str,
    y: str,
    ax,
    reference_x: tuple[float, str],
    legend: str,
    labels: tuple[str, str, str],
    higher_is_better: bool = True,
    log_y: bool = False,
) -> list:
    """Schemes as points of cost ``x`` vs ``y`` with their Pareto front; returns ``(x, y, scheme)``
    for ``plots.label_points``."""
    points = (
        results[[x, y]].astype(float).sort_values([x, y], ascending=[True, not higher_is_better])
    )
    best = points[y].cummax() if higher_is_better else points[y].cummin()
    front = points[points[y] == best]
    _ = ax.plot(front[x], front[y], color="0.6", zorder=1, label="Pareto front")
    _ = ax.scatter(points[x], points[y], zorder=2)
    _ = ax.axvline(
        reference_x[0], color="0.25", linestyle="--", linewidth=1.2, label=reference_x[1]
    )
    ax.margins(x=0.2, y=0.12)
    ax.set(yscale="log" if log_y else "linear", xlabel=labels[0], ylabel=labels[1], title=labels[2])
    _ = ax.legend(loc=legend, fontsize=8)
    return [(row[x], row[y], name) for name, row in points.iterrows()]


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
