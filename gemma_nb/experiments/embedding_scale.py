"""Notebook 06 (embedding scale): three host paths for the same lookup (``HOST_PATHS``: the story's
unscaled one, ``* math.sqrt(H)``, ``gemma_nb.embedding.HostEmbedding``) measured against the model's
own embedding."""

import math
from collections.abc import Callable

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
import torch.nn.functional as F
from torch import nn

from gemma_nb import embedding, evaluate
from gemma_nb.embedding import (
    EmbeddingCheckError,
    HostEmbedding,
    default_probe_ids,
    dtype_name,
    unit_in_last_place,
)
from gemma_nb.plots import reference_line

HOST_PATHS = ("unscaled", "math_sqrt", "module_scale")


class PythonFloatScaledLookup(nn.Module):
    """``lookup(ids) * math.sqrt(H)`` with a Python float (``scaled=False``: * 1.0, the plain
    lookup, the bug): right in fp32, one ulp off in bf16, where the module rounds the scale to the
    weight dtype first (53.066 -> 53.0)."""

    def __init__(self, weight: torch.Tensor, scaled: bool = True):
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.scale = math.sqrt(weight.shape[1]) if scaled else 1.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.weight.device), self.weight) * self.scale


def host_path(model: nn.Module, name: str) -> nn.Module:
    """One of HOST_PATHS built from ``model``'s embedding table: ids -> inputs_embeds."""
    if name in ("unscaled", "math_sqrt"):
        return PythonFloatScaledLookup(
            model.get_input_embeddings().weight, scaled=name == "math_sqrt"
        )
    assert name == "module_scale", f"host path {name!r} is not one of {', '.join(HOST_PATHS)}"
    return HostEmbedding.from_model(model)


class HostEmbeddedLM(nn.Module):
    """The model as the slim deploy runs it: ids -> ``host`` -> ``model(inputs_embeds=...)``, called
    like the model."""

    def __init__(self, model: nn.Module, host: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model, self.host, self.config = model, host, model.config

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, **kwargs):
        inputs_embeds = self.host(input_ids).to(self.model.device)
        if (
            getattr(self.model.config, "hidden_size_per_layer_input", 0)
            and "per_layer_inputs" not in kwargs
        ):
            # per-layer embeddings (not in the 26B) from ids: the model would invert embed_tokens to
            # find them
            kwargs["per_layer_inputs"] = self.model.model.get_per_layer_inputs(
                input_ids.to(self.model.device)
            )
        return self.model(inputs_embeds=inputs_embeds, **kwargs)


def scale_rounding(hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """sqrt(hidden_size) through the module's float32 buffer and its cast to ``dtype``, and the
    rounding error."""
    exact = math.sqrt(hidden_size)
    buffer = torch.tensor(exact, dtype=torch.float32)
    cast = buffer.to(dtype)
    ulp, error = unit_in_last_place(cast).item(), cast.item() - exact
    return {
        "hidden_size": hidden_size,
        "dtype": dtype_name(dtype),
        "sqrt_exact": exact,
        "scale_float32": buffer.item(),
        "scale_in_dtype": cast.item(),
        "ulp": ulp,
        "rounding_error": error,
        "rounding_error_ulps": error / ulp,
        "rounding_error_pct": 100.0 * error / exact,
    }


def host_path_elementwise(model: nn.Module, host: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """``host(ids)`` vs ``embed_tokens(ids)`` on ``default_probe_ids``: % elements differing, max
    ulps, max |diff|, norm ratio."""
    module = model.get_input_embeddings()
    probe_ids = default_probe_ids(module.weight.shape[0])
    with torch.no_grad():
        reference = module(probe_ids.to(module.weight.device)).cpu()
        candidate = host(probe_ids).cpu()
    delta = (candidate.double() - reference.double()).abs()
    ulps = delta / unit_in_last_place(reference).double().clamp_min(
        torch.finfo(reference.dtype).tiny
    )
    return {
        "differ_pct": 100.0 * (candidate != reference).double().mean().item(),
        "max_diff_ulps": ulps.max().item(),
        "max_abs_diff": delta.max().item(),
        "norm_ratio": (reference.double().norm() / candidate.double().norm()).item(),
    }


def self_check_table(model: nn.Module) -> pd.DataFrame:
    """Run the load-time self-check on each of HOST_PATHS: path, dtype, bit_exact, error,
    message."""
    module = model.get_input_embeddings()
    rows = []
    for name in HOST_PATHS:
        try:
            embedding.verify_host_path(host_path(model, name), module)
            error = None
        except EmbeddingCheckError as caught:
            error = caught
        rows.append(
            {
                "path": name,
                "dtype": dtype_name(module.weight.dtype),
                "bit_exact": error is None,
                "error": type(error).__name__ if error else "",
                "message": str(error) if error else "",
            }
        )
    return pd.DataFrame(rows)


def host_path_numerics(model: nn.Module, batches) -> pd.DataFrame:
    """Each of HOST_PATHS on ``model`` over token id ``batches``: embedding differences and
    next-token agreement."""
    reference_logits = evaluate.CachedLogits(model)
    dtype = dtype_name(model.get_input_embeddings().weight.dtype)
    rows = []
    for name in HOST_PATHS:
        candidate = HostEmbeddedLM(model, host_path(model, name))
        logits = evaluate.compare_logits(reference_logits, candidate, batches)
        rows.append(
            {
                "path": name,
                "dtype": dtype,
                **host_path_elementwise(model, candidate.host),
                "top1_agreement": logits["top1_agreement"],
                "kl_mean": logits["kl_mean"],
                "max_logit_diff": logits["max_abs_diff"],
            }
        )
    return pd.DataFrame(rows)


def compare_host_paths(model: nn.Module, tokenizer, prompt: str, steps: int, facts) -> pd.DataFrame:
    """The reference, then each of HOST_PATHS: greedy continuation of ``prompt``, recall, logit and
    embedding scores."""
    scores = host_path_numerics(
        model, evaluate.prompt_batches(tokenizer, [fact.sentence for fact in facts])
    )
    prompt_ids = tokenizer(prompt).input_ids
    rows = []
    for name, row in zip(HOST_PATHS, scores.to_dict(orient="records")):
        candidate = HostEmbeddedLM(model, host_path(model, name))
        greedy = evaluate.greedy_match(model, candidate, prompt_ids, steps, tokenizer)
        rows.append(
            {
                **row,
                "greedy": greedy["candidate_text"],
                "greedy_match": greedy["match"],
                "first_divergent_step": greedy["first_divergent_step"],
                "fact_recall": evaluate.fact_recall(candidate, tokenizer, facts)[0],
            }
        )
    reference = {
        "path": "reference (input_ids)",
        "dtype": row["dtype"],
        "greedy": greedy["reference_text"],
        "greedy_match": True,
        "first_divergent_step": None,
        "fact_recall": evaluate.fact_recall(model, tokenizer, facts)[0],
        "top1_agreement": 1.0,
        "kl_mean": 0.0,
        "max_logit_diff": 0.0,
        "norm_ratio": 1.0,
        "differ_pct": 0.0,
        "max_diff_ulps": 0.0,
    }
    # the embeddings' max |diff| is shown in ulps
    return pd.DataFrame([reference, *rows]).drop(columns="max_abs_diff")


def plot_host_paths(table: pd.DataFrame, axes, hidden_size: int) -> None:
    """Fact recall, top-1 agreement and norm ratio of ``compare_host_paths`` rows on three ``axes``,
    one legend below."""
    data = table.assign(
        fact_recall_pct=100 * table["fact_recall"], top1_pct=100 * table["top1_agreement"]
    )
    panels = [
        ("fact_recall_pct", "fact recall (%)"),
        ("top1_pct", "top-1 agreement (%)"),
        ("norm_ratio", "norm ratio, module / host (x)"),
    ]
    for index, (ax, (column, label)) in enumerate(zip(axes, panels)):
        sns.barplot(data=data, x="path", y=column, hue="dtype", ax=ax, legend=index == 0)
        ax.set(xlabel="", ylabel=label)
        plt.setp(ax.get_xticklabels(), rotation=30, horizontalalignment="right")
    # one legend for the three panels, below them, where it covers no bar
    legend = axes[0].get_legend()
    handles, labels = legend.legend_handles, [text.get_text() for text in legend.get_texts()]
    legend.remove()
    axes[0].figure.legend(
        handles,
        labels,
        title="weights",
        loc="outside lower center",
        ncols=len(labels),
        frameon=False,
    )
    # log scale, with headroom above sqrt(H), where the unscaled bars end, for the reference line's
    # label
    axes[2].set(yscale="log", ylim=(None, 4 * math.sqrt(hidden_size)))
    reference_line(
        axes[2], math.sqrt(hidden_size), f"sqrt({hidden_size}) = {math.sqrt(hidden_size):.2f}"
    )
