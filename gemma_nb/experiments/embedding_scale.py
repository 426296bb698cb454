"""Notebook 06 (embedding scale): three host paths for the same lookup, compared with the model's own.

``gemma_nb.embedding`` is the library (``HostEmbedding``, its file, ``verify_host_path``); this
module is the experiment: ``HOST_PATHS`` names the three ways a deploy can look tokens up on the
host (``unscaled``: the story's first deploy; ``math_sqrt``: ``lookup * math.sqrt(H)``;
``module_scale``: ``HostEmbedding``), ``host_path`` builds one, ``self_check_table`` /
``host_path_elementwise`` / ``host_path_numerics`` / ``compare_host_paths`` measure them against the
module (bits, ulps, logits, answers), ``scale_rounding`` shows the bf16 rounding of sqrt(H), and
``plot_host_paths`` draws the comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd
import seaborn as sns
import torch
import torch.nn.functional as F
from torch import nn

from gemma_nb import evaluate
from gemma_nb.embedding import (
    EmbeddingCheckError,
    HostEmbedding,
    default_probe_ids,
    dtype_name,
    unit_in_last_place,
    verify_host_path,
)
from gemma_nb.plots import reference_line
from gemma_nb.tiny import FACTS

HOST_PATHS = ("unscaled", "math_sqrt", "module_scale")


class UnscaledLookup(nn.Module):
    """The story's first host path: a plain lookup, no scale (the bug)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.weight.device), self.weight)


class PythonFloatScaledLookup(nn.Module):
    """``lookup(ids) * math.sqrt(hidden_size)``: right in fp32, one ulp off in bf16.

    torch multiplies a low-precision tensor by a Python float at float32 precision and rounds the
    product, whereas the module rounds the scale to the weight dtype first (bf16: 53.066 -> 53.0).
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.scale = math.sqrt(weight.shape[1])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.to(self.weight.device), self.weight) * self.scale


def host_path(model: nn.Module, name: str) -> nn.Module:
    """One of HOST_PATHS built from ``model``'s embedding table: ids -> inputs_embeds."""
    weight = model.get_input_embeddings().weight
    if name == "unscaled":
        return UnscaledLookup(weight)
    if name == "math_sqrt":
        return PythonFloatScaledLookup(weight)
    if name == "module_scale":
        return HostEmbedding.from_model(model)
    raise ValueError(f"host path {name!r} is not one of {', '.join(HOST_PATHS)}")


class HostEmbeddedLM(nn.Module):
    """The model as the slim deploy runs it: ids -> ``host`` on the cpu -> ``model(inputs_embeds=...)``.

    ``model``'s own ``embed_tokens`` is never called, exactly as in the deploy where the embedding
    lives on the host and the compiled graph starts at the decoder. Forward takes ``input_ids``
    ([batch, seq]) plus any keyword the model takes (attention_mask, cache, ...) and returns the
    model's output, so scoring code can treat it like the model fed ``input_ids``.
    """

    def __init__(self, model: nn.Module, host: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model = model
        self.host = host

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor, **kwargs):
        inputs_embeds = self.host(input_ids).to(self.model.device)
        if getattr(self.model.config, "hidden_size_per_layer_input", 0) and "per_layer_inputs" not in kwargs:
            # Per-layer embeddings (not in the 26B) are looked up from ids; the model would otherwise
            # try to recover ids by inverting embed_tokens, which fails for any host path but the exact one.
            kwargs["per_layer_inputs"] = self.model.model.get_per_layer_inputs(input_ids.to(self.model.device))
        return self.model(inputs_embeds=inputs_embeds, **kwargs)


def host_path_model(model: nn.Module, name: str) -> HostEmbeddedLM:
    """``model`` run from the inputs_embeds that host path ``name`` (one of HOST_PATHS) produces."""
    return HostEmbeddedLM(model, host_path(model, name))


def scale_rounding(hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """How sqrt(hidden_size) survives the module's float32 buffer and its cast to ``dtype``.

    Returns dtype, sqrt_exact (float64), scale_float32 (the buffer), scale_in_dtype (what the
    module multiplies by), ulp (the spacing of ``dtype`` at that value) and the rounding error
    in absolute terms, in ulps and in percent.
    """
    exact = math.sqrt(hidden_size)
    buffer = torch.tensor(exact, dtype=torch.float32)
    cast = buffer.to(dtype)
    ulp = unit_in_last_place(cast).item()
    return {
        "hidden_size": hidden_size,
        "dtype": dtype_name(dtype),
        "sqrt_exact": exact,
        "scale_float32": buffer.item(),
        "scale_in_dtype": cast.item(),
        "ulp": ulp,
        "rounding_error": cast.item() - exact,
        "rounding_error_ulps": (cast.item() - exact) / ulp,
        "rounding_error_pct": 100.0 * (cast.item() - exact) / exact,
    }


def host_path_elementwise(model: nn.Module, host: Callable[[torch.Tensor], torch.Tensor],
                          probe_ids: torch.Tensor | None = None) -> dict:
    """How ``host(ids)`` differs from ``embed_tokens(ids)`` element by element on ``probe_ids``.

    Returns the share of elements that differ (%), the largest difference in units of the
    reference element's ulp, the max |Δ| and the norm ratio reference/host.
    """
    module = model.get_input_embeddings()
    if probe_ids is None:
        probe_ids = default_probe_ids(module.weight.shape[0])
    with torch.no_grad():
        reference = module(probe_ids.to(module.weight.device)).cpu()
        candidate = host(probe_ids).cpu()
    delta = (candidate.double() - reference.double()).abs()
    ulps = delta / unit_in_last_place(reference).double().clamp_min(torch.finfo(reference.dtype).tiny)
    return {
        "differ_pct": 100.0 * (candidate != reference).double().mean().item(),
        "max_diff_ulps": ulps.max().item(),
        "max_abs_diff": delta.max().item(),
        "norm_ratio": (reference.double().norm() / candidate.double().norm()).item(),
    }


def self_check_table(model: nn.Module) -> pd.DataFrame:
    """Run the load-time self-check on each of HOST_PATHS: path, dtype, bit_exact, error, message."""
    module = model.get_input_embeddings()
    rows = []
    for name in HOST_PATHS:
        try:
            verify_host_path(host_path(model, name), module)
            error = None
        except EmbeddingCheckError as caught:
            error = caught
        rows.append({"path": name, "dtype": dtype_name(module.weight.dtype), "bit_exact": error is None,
                     "error": type(error).__name__ if error else "", "message": str(error) if error else ""})
    return pd.DataFrame(rows)


def host_path_numerics(model: nn.Module, batches) -> pd.DataFrame:
    """Each of HOST_PATHS on ``model``: embedding differences and next-token agreement, no tokenizer.

    ``batches``: token id batches ([B, S] LongTensor or a list of them) fed to the reference
    (``model`` on ``input_ids``) and to each host path. Columns: path, dtype, norm_ratio,
    differ_pct, max_diff_ulps, max_abs_diff (embeddings), top1_agreement, kl_mean (nats),
    max_logit_diff.
    """
    reference_logits = evaluate.CachedLogits(model)
    rows = []
    for name in HOST_PATHS:
        host = host_path(model, name)
        logits = evaluate.compare_logits(reference_logits, HostEmbeddedLM(model, host), batches)
        rows.append({"path": name, "dtype": dtype_name(model.get_input_embeddings().weight.dtype),
                     **host_path_elementwise(model, host),
                     "top1_agreement": logits["top1_agreement"], "kl_mean": logits["kl_mean"],
                     "max_logit_diff": logits["max_abs_diff"]})
    return pd.DataFrame(rows)


def compare_host_paths(model: nn.Module, tokenizer, prompt: str = "The capital of France is",
                       steps: int = 8, facts=None, batches=None) -> pd.DataFrame:
    """Each of HOST_PATHS against ``model`` fed ``input_ids`` (the reference): one row per path.

    The first row is the reference itself. Columns: path, dtype, greedy (greedy continuation of
    ``prompt``, ``steps`` tokens), greedy_match, first_divergent_step (None when it matches),
    fact_recall (0-1, over ``facts``, default the whole corpus), top1_agreement and kl_mean
    (nats) and max_logit_diff over ``batches`` (default: the sentences of ``facts``), norm_ratio
    (||embed_tokens(ids)|| / ||host(ids)||), differ_pct (share of embedding elements not
    bit-equal to the module's) and max_diff_ulps (in units of the module output's ulp).
    """
    if facts is None:
        facts = FACTS
    facts = list(facts)
    if batches is None:
        batches = evaluate.prompt_batches(tokenizer, [fact.sentence for fact in facts])
    dtype = dtype_name(model.get_input_embeddings().weight.dtype)
    reference_logits = evaluate.CachedLogits(model)
    prompt_ids = torch.tensor([tokenizer(prompt).input_ids])
    reference_tokens = evaluate.greedy_generate(model, prompt_ids, steps)[0, prompt_ids.shape[1]:].tolist()
    rows = [{
        "path": "reference (input_ids)", "dtype": dtype, "greedy": tokenizer.decode(reference_tokens),
        "greedy_match": True, "first_divergent_step": None,
        "fact_recall": evaluate.fact_recall(model, tokenizer, facts)[0],
        "top1_agreement": 1.0, "kl_mean": 0.0, "max_logit_diff": 0.0, "norm_ratio": 1.0, "differ_pct": 0.0,
        "max_diff_ulps": 0.0,
    }]
    for name in HOST_PATHS:
        host = host_path(model, name)
        candidate = HostEmbeddedLM(model, host)
        tokens = evaluate.greedy_generate(candidate, prompt_ids, steps)[0, prompt_ids.shape[1]:].tolist()
        first = next((i for i, (r, c) in enumerate(zip(reference_tokens, tokens)) if r != c), None)
        logits = evaluate.compare_logits(reference_logits, candidate, batches)
        elementwise = host_path_elementwise(model, host)
        rows.append({
            "path": name,
            "dtype": dtype,
            "greedy": tokenizer.decode(tokens),
            "greedy_match": first is None,
            "first_divergent_step": first,
            "fact_recall": evaluate.fact_recall(candidate, tokenizer, facts)[0],
            "top1_agreement": logits["top1_agreement"],
            "kl_mean": logits["kl_mean"],
            "max_logit_diff": logits["max_abs_diff"],
            "norm_ratio": elementwise["norm_ratio"],
            "differ_pct": elementwise["differ_pct"],
            "max_diff_ulps": elementwise["max_diff_ulps"],
        })
    return pd.DataFrame(rows)


def plot_host_paths(table: pd.DataFrame, axes, hidden_size: int) -> None:
    """Three panels from ``compare_host_paths`` rows (all dtypes): fact recall, top-1 agreement, norm ratio.

    ``axes``: three matplotlib axes of one figure (with constrained layout: the dtype legend goes
    below them). The norm ratio is drawn on a log scale with sqrt(hidden_size) as a reference line:
    an unscaled path sits on it, a correct one at 1.
    """
    data = table.assign(fact_recall_pct=100 * table["fact_recall"], top1_pct=100 * table["top1_agreement"])
    panels = [("fact_recall_pct", "fact recall (%)"), ("top1_pct", "top-1 agreement (%)"),
              ("norm_ratio", "norm ratio, module / host (x)")]
    for index, (ax, (column, label)) in enumerate(zip(axes, panels)):
        sns.barplot(data=data, x="path", y=column, hue="dtype", ax=ax, legend=index == 0)
        ax.set_xlabel("")
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelrotation=30)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
    # one legend for the three panels, below them, where it covers no bar
    legend = axes[0].get_legend()
    handles, labels = legend.legend_handles, [text.get_text() for text in legend.get_texts()]
    legend.remove()
    axes[0].figure.legend(handles, labels, title="weights", loc="outside lower center", ncols=len(labels), frameon=False)
    axes[2].set_yscale("log")
    # headroom above sqrt(H), where the unscaled bars end, for the reference line's label
    axes[2].set_ylim(top=4 * math.sqrt(hidden_size))
    reference_line(axes[2], math.sqrt(hidden_size), f"sqrt({hidden_size}) = {math.sqrt(hidden_size):.2f}")


__all__ = [
    "HOST_PATHS", "UnscaledLookup", "PythonFloatScaledLookup", "HostEmbeddedLM", "host_path", "host_path_model",
    "scale_rounding", "host_path_elementwise", "host_path_numerics", "self_check_table", "compare_host_paths",
    "plot_host_paths",
]
