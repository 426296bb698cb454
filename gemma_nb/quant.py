"""Quantized modules and schemes on a Gemma-4 model, measured (notebook 02).

The formats themselves (int8, fp8 e4m3, MXFP4, NVFP4: what they store, their bytes, the quantizer
``quantize`` and ``QuantizedTensor``) live in ``gemma_nb.formats``, shared with the memory planner;
the routed experts on quantized weights (``QuantizedExperts``) in ``gemma_nb.experts``. Here:

- ``Int8Linear`` (the port's int8 linear: ``gemma_nb.formats.int8_matmul``, NxD's order) and
  ``QuantizedLinear`` (any format, dequantized to the activation dtype in its forward).
- ``apply_scheme(model, scheme)``: quantize a loaded Gemma-4 model's groups (experts, shared MLP,
  attention, lm_head) in place; scheme names are the memory planner's.
- ``full_size_experts_check``, ``evaluate_scheme``, ``lm_head_isolation``: what notebook 02 measures.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn

from gemma_nb import memory
from gemma_nb.experts import QuantizedExperts, SparseExperts
from gemma_nb.formats import (
    QUANTIZED_FORMATS,
    QuantizedTensor,
    int8_matmul,
    one_intra_op_thread,
    quantization_error,
    quantize,
    register_quantized,
    registered_quantized,
    weight_format,
)
from gemma_nb.moe import random_routing

# The formats this module quantizes to (``gemma_nb.formats.QUANTIZED_FORMATS``), by name.
FORMATS = QUANTIZED_FORMATS


# ---------------------------------------------------------------------------------------------
# Quantized modules
# ---------------------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """Weight-only int8 ``nn.Linear`` (no bias): buffers ``qweight int8 [out, in]``, ``scale fp32 [out, 1]``.

    Forward is :func:`int8_matmul`. Build one from a float linear with :meth:`from_linear` or from a
    raw weight with :meth:`from_weight`. ``nbytes`` counts the stored int8 weight plus the fp32 scales.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be 2-D int8; got {qweight.dtype} {tuple(qweight.shape)}")
        if scale.shape != (qweight.shape[0], 1):
            raise ValueError(f"scale must be [out, 1] = {(qweight.shape[0], 1)}; got {tuple(scale.shape)}")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.float())

    @classmethod
    def from_weight(cls, weight: torch.Tensor, name: str = "weight") -> "Int8Linear":
        """Same numbers as :func:`quantize_int8_per_channel`, computed in bounded-memory chunks."""
        if weight.dim() != 2:
            raise ValueError(f"{name!r} has shape {tuple(weight.shape)}; Int8Linear needs a 2-D weight [out, in]")
        quantized = quantize(weight, "int8", name=name)
        return cls(quantized.data, quantized.scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear, name: str = "linear") -> "Int8Linear":
        if getattr(linear, "bias", None) is not None:
            raise ValueError(f"{name!r} has a bias; Int8Linear covers the bias-free linears Gemma-4 uses")
        return cls.from_weight(linear.weight, name=f"{name}.weight")

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    @property
    def quantized(self) -> "QuantizedTensor":
        """The same weight as a :class:`QuantizedTensor` (format ``int8``), sharing storage."""
        return QuantizedTensor("int8", self.qweight, self.scale, tuple(self.qweight.shape), name="int8_linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


class QuantizedLinear(nn.Module):
    """Bias-free linear holding a :class:`QuantizedTensor`; forward dequantizes to ``x.dtype``.

    ``F.linear(x, Q.dequantize(x.dtype))``: how NxD runs its fp8 and blockwise layers (weight
    dequantized before the matmul). For int8 use :class:`Int8Linear`, which scales the output.
    """

    def __init__(self, quantized: QuantizedTensor):
        super().__init__()
        if len(quantized.shape) != 2:
            raise ValueError(f"{quantized.name!r} has shape {quantized.shape}; a linear needs [out, in]")
        self._quantized_meta = {}
        register_quantized(self, "weight", quantized)
        self.out_features, self.in_features = quantized.shape

    @property
    def quantized(self) -> QuantizedTensor:
        return registered_quantized(self, "weight")

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.quantized.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.quantized.fmt}"


def quantized_linear(weight: torch.Tensor, fmt: str, name: str = "weight") -> nn.Module:
    """An :class:`Int8Linear` (``fmt == "int8"``) or a :class:`QuantizedLinear` for ``weight [out, in]``."""
    if fmt == "int8":
        return Int8Linear.from_weight(weight, name=name)
    return QuantizedLinear(quantize(weight, fmt, name=name))


# ---------------------------------------------------------------------------------------------
# Schemes: which group of a Gemma-4 model gets which format
# ---------------------------------------------------------------------------------------------

GROUPS = ("experts", "shared_mlp", "attention", "lm_head")


def resolve_scheme(scheme) -> dict[str, str]:
    """A scheme -> ``{group: format}`` for the groups to quantize (groups in bf16 are left out).

    ``scheme``: a name from the memory planner (``gemma_nb.memory.SCHEMES``: ``bf16``,
    ``int8_experts``, ``int8_experts_shared_mlp``, ``int8_squeeze``, ``fp8_experts``,
    ``mxfp4_experts``, ``nvfp4_experts``, ...), a ``memory.Scheme``, or a ``{group: format}`` dict.
    The planner's placement (sharding, host embedding) does not apply to a single-device model;
    only its formats do.
    """
    if isinstance(scheme, (str, memory.Scheme)):
        scheme = memory.get_scheme(scheme).dtypes
    resolved = {}
    for group, fmt in scheme.items():
        if group not in GROUPS:
            if fmt in (None, "bf16", "fp32"):
                continue
            raise ValueError(f"group {group!r} cannot be quantized here; quantizable groups: {', '.join(GROUPS)}")
        if fmt in (None, "bf16", "fp32"):
            continue
        weight_format(fmt)
        resolved[group] = fmt
    return resolved


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "Gemma4TextDecoderLayer"]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no Gemma4TextDecoderLayer; apply_scheme needs a Gemma-4 model")
    return layers


def _linear_targets(layers, group: str) -> list[tuple[nn.Module, str, str]]:
    """(parent module, attribute, dotted name) of every nn.Linear in ``group``."""
    sub, attrs = {"shared_mlp": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                  "attention": ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj"))}[group]
    targets = []
    for layer_name, layer in layers:
        parent = getattr(layer, sub)
        for attr in attrs:
            if isinstance(getattr(parent, attr, None), nn.Linear):
                targets.append((parent, attr, f"{layer_name}.{sub}.{attr}"))
    return targets


def _row(group, fmt, params, stored_bytes, errors) -> dict:
    """One report row; ``errors`` is None when the errors were not measured (NaN columns)."""
    if errors is None:
        rel_error = max_abs_error = float("nan")
    else:
        diff_sq = sum(e["rel_error"] ** 2 * e["ref_sq"] for e in errors)
        ref_sq = sum(e["ref_sq"] for e in errors)
        rel_error = math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else 0.0
        max_abs_error = max((e["max_abs_error"] for e in errors), default=0.0)
    return {"group": group, "format": fmt, "params": params, "bf16_bytes": 2 * params, "stored_bytes": stored_bytes,
            "rel_error": rel_error, "max_abs_error": max_abs_error}


def _error(weight: torch.Tensor, quantized: QuantizedTensor) -> dict[str, float]:
    err = quantization_error(weight, quantized)
    err["ref_sq"] = float(weight.float().square().sum())
    return err


def _quantize_experts(layers, fmt: str):
    """Every layer's ``Gemma4TextExperts`` -> ``QuantizedExperts``; yields ((weight, quantized) pairs, stored bytes)."""
    for layer_name, layer in layers:
        experts = getattr(layer, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj"):
            raise ValueError(f"{layer_name} has no stacked experts (gate_up_proj): "
                             "the config needs enable_moe_block=True")
        quantized = QuantizedExperts.from_experts(experts, fmt, name=f"{layer_name}.experts")
        layer.experts = quantized
        yield ((experts.gate_up_proj, quantized.gate_up), (experts.down_proj, quantized.down)), quantized.nbytes


def _quantize_linears(model, layers, group: str, fmt: str):
    """Every linear of ``group`` -> ``Int8Linear`` / ``QuantizedLinear``; yields as :func:`_quantize_experts`."""
    if group == "lm_head":
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise ValueError(f"lm_head is {type(head).__name__}, already replaced; apply lm_head quantization once")
        # a new quantized table; the tied float table stays with embed_tokens
        replacement = quantized_linear(head.weight.detach(), fmt, "lm_head.weight")
        model.lm_head = replacement
        model.config.tie_word_embeddings = False
        yield ((head.weight.detach(), replacement.quantized),), replacement.nbytes
        return
    for parent, attr, name in _linear_targets(layers, group):
        linear = getattr(parent, attr)
        if linear.bias is not None:
            raise ValueError(f"{name} has a bias; the quantized linears cover Gemma-4's bias-free ones")
        replacement = quantized_linear(linear.weight.detach(), fmt, f"{name}.weight")
        setattr(parent, attr, replacement)
        yield ((linear.weight, replacement.quantized),), replacement.nbytes


@torch.no_grad()
def apply_scheme(model: nn.Module, scheme: str | Mapping[str, str], measure_error: bool = True):
    """Quantize a loaded transformers Gemma-4 model in place, group by group; return a report.

    Groups: ``experts`` (every ``Gemma4TextExperts`` -> ``gemma_nb.experts.QuantizedExperts``),
    ``shared_mlp`` (``mlp.gate/up/down_proj``), ``attention`` (``self_attn.q/k/v/o_proj``; global
    layers have no ``v_proj`` when ``attention_k_eq_v``), ``lm_head`` (the tie with ``embed_tokens``
    is broken: the input embedding keeps its float table, ``lm_head`` gets its own quantized copy).
    Linears become :class:`Int8Linear` for int8, else :class:`QuantizedLinear`.

    Returns a DataFrame, one row per quantized group: ``params``, ``bf16_bytes`` (2 per param),
    ``stored_bytes`` (what the quantized tensors occupy), ``rel_error`` (Frobenius, whole group)
    and ``max_abs_error`` of the dequantized weights against the weights they replaced (NaN with
    ``measure_error=False``, which skips that measurement: most of the time of a deploy's squeeze).
    """
    import pandas as pd

    groups = resolve_scheme(scheme)
    layers = _decoder_layers(model)
    rows = []
    for group, fmt in groups.items():
        params = stored = 0
        errors = [] if measure_error else None
        if group == "experts":
            replaced = _quantize_experts(layers, fmt)
        else:
            replaced = _quantize_linears(model, layers, group, fmt)
        for pairs, nbytes in replaced:
            stored += nbytes
            for weight, quantized in pairs:
                params += weight.numel()
                if measure_error:
                    errors.append(_error(weight, quantized))
        rows.append(_row(group, fmt, params, stored, errors))
    return pd.DataFrame(rows, columns=["group", "format", "params", "bf16_bytes", "stored_bytes",
                                       "rel_error", "max_abs_error"])


# ---------------------------------------------------------------------------------------------
# One full-size layer, quantized for real, against the memory planner's byte formula
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def full_size_experts_check(experts: nn.Module, formats=("int8", "mxfp4", "nvfp4"), tokens: int = 4,
                            top_k: int = 8, seed: int = 0):
    """Quantize one layer's stacked experts to each format; stored bytes vs ``memory.tensor_bytes``.

    ``experts``: a ``Gemma4TextExperts`` (e.g. :func:`random_experts_fast` at the 26B's
    128 x 1408 x 2816 / 128 x 2816 x 704). One format at a time, so peak memory is the float
    weights plus one quantized copy. Returns (table, seconds): one row per (format, tensor) plus a
    ``layer`` row per format with ``stored_bytes``, ``planner_bytes``, ``equal``, the relative
    weight error of expert 0 and, on the layer row, the relative error of the layer output for
    ``tokens`` random tokens routed to ``top_k`` experts; ``seconds`` maps format -> quantize time.
    Runs on one intra-op thread (see :func:`quantize`).
    """
    with one_intra_op_thread():
        return _full_size_experts_check(experts, formats, tokens, top_k, seed)


def _full_size_experts_check(experts, formats, tokens, top_k, seed):
    import time

    import pandas as pd

    generator = torch.Generator().manual_seed(seed)
    dtype = experts.gate_up_proj.dtype
    hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=generator).to(dtype)
    index, weights = random_routing(tokens, experts.gate_up_proj.shape[0], top_k, seed=seed)
    # transformers' eager loop on the float weights: what QuantizedExperts computes, unquantized
    float_experts = SparseExperts.from_experts(experts)
    reference = float_experts.grouped(hidden, index, weights.to(dtype), accumulate_dtype=None).float()
    rows, seconds = [], {}
    for fmt in formats:
        weight_format(fmt)
        start = time.perf_counter()
        quantized = QuantizedExperts.from_experts(experts, fmt, name="experts")
        seconds[fmt] = time.perf_counter() - start
        for tensor_name, tensor in (("gate_up_proj", quantized.gate_up), ("down_proj", quantized.down)):
            weight = getattr(experts, tensor_name)
            rows.append({
                "format": fmt, "tensor": tensor_name, "shape": "x".join(map(str, tensor.shape)),
                "stored_bytes": tensor.nbytes, "planner_bytes": memory.tensor_bytes(tensor.shape, fmt),
                "rel_error_expert0": quantization_error(weight[0], tensor[0])["rel_error"],
            })
        output = quantized(hidden, index, weights.to(dtype)).float()
        rows.append({
            "format": fmt, "tensor": "layer", "shape": "",
            "stored_bytes": quantized.nbytes,
            "planner_bytes": sum(memory.tensor_bytes(t.shape, fmt) for t in (quantized.gate_up, quantized.down)),
            "rel_error_output": float((output - reference).norm() / reference.norm()),
        })
        del quantized
    table = pd.DataFrame(rows)
    table.insert(5, "equal", table["stored_bytes"] == table["planner_bytes"])
    return table, seconds


def random_experts_fast(config, seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A ``Gemma4TextExperts`` with N(0, std) weights drawn straight into ``dtype``, expert by expert.

    Like ``gemma_nb.moe.random_experts`` (not the same numbers) but ~3x faster on a busy 2-core box:
    ``normal_`` fills the bf16 tensor in place on one intra-op thread (1.5 GB at full size).
    """
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    with torch.device("meta"):
        module = Gemma4TextExperts(config)
    generator = torch.Generator().manual_seed(seed)
    with one_intra_op_thread():
        for name in ("gate_up_proj", "down_proj"):
            weight = torch.empty(getattr(module, name).shape, dtype=dtype)
            for e in range(weight.shape[0]):
                weight[e].normal_(0.0, std, generator=generator)
            setattr(module, name, nn.Parameter(weight, requires_grad=False))
    return module


# ---------------------------------------------------------------------------------------------
# Measuring a scheme on a checkpoint (notebook 02)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_tokens(model, tokenizer, prompts, steps: int) -> list[list[int]]:
    """``steps`` greedy new tokens per prompt, batched by prompt length (no padding).

    After a row emits the tokenizer's eos it keeps emitting eos, so two models are compared on
    their answers, not on whatever follows the end of the sequence.
    """
    from gemma_nb.evaluate import greedy_generate

    token_lists = [tokenizer(p).input_ids for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(token_lists):
        by_length.setdefault(len(ids), []).append(i)
    for length, indices in sorted(by_length.items()):
        batch = torch.tensor([token_lists[i] for i in indices])
        generated = greedy_generate(model, batch, steps, eos_token_id=tokenizer.eos_token_id)[:, length:].tolist()
        for i, row in zip(indices, generated):
            # decoding stops early once every row has emitted eos: pad with eos to ``steps``
            out[i] = row + [tokenizer.eos_token_id] * (steps - len(row))
    return out


def greedy_table(prompts, reference_tokens, candidate_tokens, tokenizer):
    """Per prompt: ``match`` (all tokens equal), ``first_divergent_step`` (or None) and both texts."""
    import pandas as pd

    rows = []
    for prompt, ref, cand in zip(prompts, reference_tokens, candidate_tokens):
        first = next((i for i, (r, c) in enumerate(zip(ref, cand)) if r != c), None)
        rows.append({"prompt": prompt, "match": first is None, "first_divergent_step": first,
                     "reference": tokenizer.decode(ref), "candidate": tokenizer.decode(cand)})
    table = pd.DataFrame(rows, columns=["prompt", "match", "first_divergent_step", "reference", "candidate"])
    table["first_divergent_step"] = table["first_divergent_step"].astype("Int64")
    return table


@torch.no_grad()
def divergence_detail(reference, candidate, tokenizer, prompt: str, reference_tokens: list[int], step: int, k: int = 3):
    """Why greedy decoding diverged at ``step``: both models' top-``k`` next tokens on the same prefix.

    The prefix is the prompt plus the reference's first ``step`` tokens (identical in both runs up
    to there). Columns: model, rank, token, logit, and the gap to the model's top logit.
    """
    import pandas as pd

    ids = torch.tensor([tokenizer(prompt).input_ids + reference_tokens[:step]])
    rows = []
    for label, model in (("reference", reference), ("candidate", candidate)):
        logits = model(input_ids=ids).logits[0, -1].float()
        values, indices = logits.topk(k)
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist())):
            rows.append({"model": label, "rank": rank + 1, "token": tokenizer.decode([index]),
                         "logit": value, "gap_to_top": values[0].item() - value})
    return pd.DataFrame(rows)


def evaluate_scheme(reference, tokenizer, scheme, dtype: torch.dtype = torch.bfloat16, facts=None,
                    reference_greedy: list[list[int]] | None = None, steps: int = 4, device: str = "cpu"):
    """Apply ``scheme`` to a copy of ``reference`` cast to ``dtype`` and score it against ``reference``.

    Returns ``(model, summary, report, greedy)``: the quantized copy; a dict with
    ``top1_agreement``, ``kl_mean``, ``max_abs_diff`` (next-token logits at every position of every
    fact's sentence, ``gemma_nb.evaluate.compare_logits``), ``fact_recall``, ``greedy_match`` (fraction of fact
    prompts whose ``steps`` greedy tokens equal the reference's token for token),
    ``quantized_bytes`` / ``quantized_bf16_bytes``; the per-group report of :func:`apply_scheme`;
    and the per-prompt greedy table. ``reference_greedy`` (from :func:`greedy_tokens`) saves
    recomputing the reference's tokens for every scheme.
    """
    import copy

    from gemma_nb import evaluate

    if facts is None:
        from gemma_nb.tiny import FACTS as facts
    prompts = [f.prompt for f in facts]
    model = copy.deepcopy(reference).to(dtype)
    report = apply_scheme(model, scheme)
    model = model.to(device).eval()
    if reference_greedy is None:
        reference_greedy = greedy_tokens(reference, tokenizer, prompts, steps)
    # next-token logits at every position of the facts' own sentences (default: the whole corpus)
    logits = evaluate.compare_logits(reference, model, [f.sentence for f in facts], tokenizer=tokenizer)
    recall, _ = evaluate.fact_recall(model, tokenizer, facts)
    greedy = greedy_table(prompts, reference_greedy, greedy_tokens(model, tokenizer, prompts, steps), tokenizer)
    summary = {
        "top1_agreement": logits["top1_agreement"], "kl_mean": logits["kl_mean"],
        "max_abs_diff": logits["max_abs_diff"], "fact_recall": recall,
        "greedy_match": float(greedy["match"].mean()),
        "quantized_bytes": int(report["stored_bytes"].sum()), "quantized_bf16_bytes": int(report["bf16_bytes"].sum()),
    }
    return model, summary, report, greedy


def formats_table(shape=(1408, 2816)):
    """The formats side by side: element bits, block, scale layout, and bytes per weight of one ``shape`` matrix.

    ``shape`` defaults to one 26B expert's gate_up matrix; bytes come from ``memory.tensor_bytes``.
    """
    import pandas as pd

    from gemma_nb import memory

    rows = [{"format": "bf16", "element_bits": 16, "block": None, "scale": "none", "per_tensor_scale": False,
             "bytes_per_weight": memory.tensor_bytes(shape, "bf16") / math.prod(shape), "description": "bfloat16"}]
    for f in FORMATS.values():
        per = "row" if f.block_size is None else f"{f.block_size} inputs"
        scale = f"{str(f.scale_dtype).replace('torch.', '')} per {per}"
        rows.append({"format": f.name, "element_bits": f.element_bits, "block": f.block_size, "scale": scale,
                     "per_tensor_scale": f.per_tensor_scale,
                     "bytes_per_weight": memory.tensor_bytes(shape, f.name) / math.prod(shape),
                     "description": f.description})
    table = pd.DataFrame(rows)
    table["block"] = table["block"].astype("Int64")
    return table


@torch.no_grad()
def lm_head_isolation(model, tokenizer, fmt: str = "int8", texts=None) -> dict:
    """The head alone: the model's own final hidden states through its float head vs a ``fmt`` copy.

    Captures the input of ``model.lm_head`` on every corpus sentence (or ``texts``), then compares
    ``F.linear(h, W)`` with the quantized head on the same ``h`` (softcap left out: it is monotonic,
    argmax and margins keep their order). Returns ``positions``, ``top1_agreement``,
    ``max_abs_logit_error``, the float head's top-1 minus top-2 logit margin (``margin_min``,
    ``margin_median``) and ``near_ties`` (positions whose margin is below twice the max logit error,
    the only ones a quantized head could flip).
    """
    from gemma_nb.evaluate import prompt_batches

    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"model.lm_head is {type(head).__name__}; pass the float model, before apply_scheme")
    captured = []
    hook = head.register_forward_hook(
        lambda module, args, output: captured.append(args[0].reshape(-1, args[0].shape[-1])))
    try:
        for ids in prompt_batches(tokenizer, texts):
            model(input_ids=ids)
    finally:
        hook.remove()
    hidden = torch.cat(captured)
    exact = torch.nn.functional.linear(hidden, head.weight).float()
    quantized = quantized_linear(head.weight.detach(), fmt, "lm_head.weight")(hidden).float()
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


def score_schemes(reference, tokenizer, schemes, reference_greedy, steps: int, device: str = "cpu",
                  dtypes=(torch.bfloat16, torch.float32)):
    """:func:`evaluate_scheme` for every scheme, once per compute dtype; one row per scheme.

    The first dtype (bf16, the port's) gives every column; each further dtype adds
    ``top1_agreement_<dtype>`` and ``kl_mean_<dtype>``: in fp32 compute the only difference from the
    reference is the quantization itself, so those columns isolate its cost from bf16 rounding.
    Returns ``(results, models, reports, greedy)``, the last three keyed by scheme (first dtype).
    """
    import pandas as pd

    models, reports, greedy, rows = {}, {}, {}, {}
    for name in schemes:
        key = name if isinstance(name, str) else str(name)
        first, *others = dtypes
        models[key], summary, reports[key], greedy[key] = evaluate_scheme(
            reference, tokenizer, name, dtype=first, reference_greedy=reference_greedy, steps=steps, device=device)
        for dtype in others:
            extra = evaluate_scheme(reference, tokenizer, name, dtype=dtype, reference_greedy=reference_greedy,
                                    steps=steps, device=device)[1]
            label = str(dtype).replace("torch.", "")
            summary[f"top1_agreement_{label}"] = extra["top1_agreement"]
            summary[f"kl_mean_{label}"] = extra["kl_mean"]
        rows[key] = summary
    results = pd.DataFrame(rows).T
    results.index.name = "scheme"
    return results, models, reports, greedy



def score_findings(results, weight_errors, reference_recall: float) -> dict:
    """What the tables of :func:`score_schemes` say, as values a notebook can word its sentences from.

    ``results``: the scores (with the ``*_float32`` columns; must hold ``bf16``); ``weight_errors``:
    the per-group reports stacked with a ``scheme`` column; ``reference_recall``: the fp32 model's
    fact recall. Returns ``kept`` / ``changed`` (schemes that keep / lose the reference's fact recall
    or a greedy answer), ``bf16_disagreement`` (1 - bf16's top-1 agreement: bf16 rounding alone),
    ``top1_spread`` (largest |top-1 agreement - bf16's| of the other schemes, bf16 compute) and
    ``top1_both_sides`` (some above bf16's, some below), ``kl_order`` (the quantized schemes by KL in
    fp32 compute, smallest first), ``experts_by_kl`` / ``experts_by_weight_error`` (the experts-only
    schemes ordered by that KL and by their experts' relative weight error), ``follows_weight_error``
    (the two orders agree), and, where the schemes are scored, ``shared_mlp_kl_added`` (fp32-compute
    KL that an int8 dense MLP adds to int8 experts) and ``lm_head_kl_added`` (what the squeeze's int8
    lm_head adds on top of both).
    """
    kept = results.index[(results["fact_recall"] == reference_recall) & (results["greedy_match"] == 1.0)]
    quantized = results.drop(index="bf16")
    top1_delta = quantized["top1_agreement"] - results.loc["bf16", "top1_agreement"]
    experts_only = [s for s in quantized.index if set(resolve_scheme(s)) == {"experts"}]
    expert_errors = weight_errors[weight_errors["group"] == "experts"].set_index("scheme")["rel_error"]
    experts_by_kl = list(quantized.loc[experts_only, "kl_mean_float32"].sort_values().index)
    experts_by_error = list(expert_errors.loc[experts_only].sort_values().index)
    kl = results["kl_mean_float32"]
    has = set(results.index).issuperset
    return {
        "kept": list(kept), "changed": [s for s in results.index if s not in kept],
        "bf16_disagreement": 1.0 - float(results.loc["bf16", "top1_agreement"]),
        "top1_spread": float(top1_delta.abs().max()),
        "top1_both_sides": bool((top1_delta > 0).any() and (top1_delta < 0).any()),
        "kl_order": list(quantized["kl_mean_float32"].sort_values().index),
        "experts_by_kl": experts_by_kl, "experts_by_weight_error": experts_by_error,
        "follows_weight_error": experts_by_kl == experts_by_error,
        "shared_mlp_kl_added": float(kl["int8_experts_shared_mlp"] - kl["int8_experts"])
        if has({"int8_experts", "int8_experts_shared_mlp"}) else None,
        "lm_head_kl_added": float(kl["int8_squeeze"] - kl["int8_experts_shared_mlp"])
        if has({"int8_experts_shared_mlp", "int8_squeeze"}) else None,
    }


def plot_pareto(results, x: str, y: str, ax, higher_is_better: bool = True) -> None:
    """Schemes as labelled points of ``results[x]`` (cost, lower is better) vs ``results[y]``, with the Pareto front.

    A scheme is on the front when no other scheme is both cheaper (or as cheap) and better.
    """
    points = results[[x, y]].astype(float).sort_values([x, y], ascending=[True, not higher_is_better])
    best = points[y].cummax() if higher_is_better else points[y].cummin()
    front = points[points[y] == best]
    _ = ax.plot(front[x], front[y], color="0.6", zorder=1, label="Pareto front")
    _ = ax.scatter(points[x], points[y], zorder=2)
    # stagger the labels of points that sit at the same height, so they stay readable
    for i, (name, row) in enumerate(points.iterrows()):
        _ = ax.annotate(name, (row[x], row[y]), xytext=(4, (4, -11, 15)[i % 3]), textcoords="offset points",
                        fontsize=8)
    _ = ax.legend(loc="best")
