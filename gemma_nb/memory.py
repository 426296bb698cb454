"""Where a causal LM's bytes go: parameter inventory, per-rank byte plans, and fit per NeuronCore.

Three questions, one function each (notebook 01):

- ``inventory(config)``: build the model for any transformers causal-LM config on the meta device
  (no weights, no download, ~1 s for the 26B) and count its unique parameters per group:
  ``experts`` (routed), ``router``, ``shared_mlp`` (the dense MLP; Gemma-4's "shared expert"),
  ``attention`` (q/k/v/o projections), ``norms``, ``embeddings`` (input table), ``lm_head`` (0 when
  tied: the tie is reported and the table counted once, under ``embeddings``),
  ``per_layer_embeddings`` (Gemma's PLE) and ``other``. Persistent buffers (Gemma-4's
  ``layer_scalar``) are not parameters: they are counted apart, in the ``buffers`` column.
- ``plan(config, tp, scheme, context_len)``: bytes per rank per group for a placement ``Scheme``
  (dtype per group, which groups are sharded, lm_head replicated or sharded, embedding on host or
  device), plus the KV cache and an explicit, labelled ``runtime_allowance``.
- ``hardware.fits(plan, instance)``: headroom per NeuronCore (see ``gemma_nb.hardware``).

The formats and their byte formula (``tensor_bytes``) are ``gemma_nb.formats``', the registry the
quantizers read too, so the stored bytes of a quantized layer equal the planner's figure exactly
(tested). Sizes are in bytes; ``_gb`` columns are 10^9 bytes.

One concern in one module (~800 lines): the planner's byte arithmetic, from the config's inventory
through the KV cache to a plan per rank and its fit; ``python -m gemma_nb plan`` and notebook 01
read the same functions. Notebook 01's own figures (``story_figures``, the plots) are
``gemma_nb.experiments.memory_arithmetic``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gemma_nb.formats import FORMATS, PLAIN_DTYPES, get_format, tensor_bytes
from gemma_nb.hardware import GB, INSTANCES, GiB, fits, get_instance

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
GEMMA4_26B_CONFIG_PATH = CONFIGS_DIR / "gemma4_26b_a4b.json"

GROUPS = (
    "experts",
    "router",
    "shared_mlp",
    "attention",
    "norms",
    "embeddings",
    "lm_head",
    "per_layer_embeddings",
    "other",
)
# Groups TP can split. Router, norms and scale vectors stay replicated (the port kept them so).
SHARDABLE_GROUPS = ("experts", "attention", "shared_mlp")
PLAN_ROWS = GROUPS + ("kv_cache", "runtime_allowance")


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


def load_config(path_or_dict: str | Path | Mapping[str, Any]):
    """A transformers config from a ``config.json`` path or a dict with a ``model_type`` key."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(path_or_dict, Mapping):
        raw = dict(path_or_dict)
    else:
        path = Path(path_or_dict)
        if not path.is_file():
            raise ValueError(f"config file {path.name!r} does not exist; pass a config.json path or a dict")
        raw = json.loads(path.read_text())
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ValueError("config has no 'model_type' key; add one (e.g. 'gemma4_text', 'mixtral', 'llama')")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model_type {model_type!r} is not known to this transformers version")
    return CONFIG_MAPPING[model_type].from_dict(raw)


def check_gemma4_pitfalls(raw: Mapping[str, Any]) -> None:
    """Raise ValueError if a Gemma-4 26B config dict would silently build a different model.

    - ``hidden_size_per_layer_input`` defaults to 256 in ``Gemma4TextConfig``: per-layer embeddings
      the 26B does not have (+2,078,231,296 params). It must be present and 0.
    - ``attention_k_eq_v`` defaults to False: global layers then get a v_proj and 8 KV heads
      (+100.9M params). It must be present (True for the 26B).
    - ``final_logit_softcapping`` defaults to None: logits uncapped. It must be set (30.0).
    """
    if raw.get("hidden_size_per_layer_input", 256) != 0:
        raise ValueError(
            f"hidden_size_per_layer_input={raw.get('hidden_size_per_layer_input', '<missing: default 256>')!r}: "
            "the 26B has no per-layer embeddings; set it to 0 (the transformers default 256 adds 2.08B params)"
        )
    if "attention_k_eq_v" not in raw:
        raise ValueError(
            "attention_k_eq_v is missing: the default False gives global layers a v_proj and 8 KV heads "
            "(+100.9M params); set attention_k_eq_v: true for Gemma-4-26B-A4B"
        )
    if raw.get("final_logit_softcapping") is None:
        raise ValueError(
            "final_logit_softcapping is missing or null: the default None leaves logits uncapped; "
            "set it to 30.0 for Gemma-4-26B-A4B"
        )


def load_gemma4_26b_config(path: str | Path = GEMMA4_26B_CONFIG_PATH):
    """The Gemma-4-26B-A4B text config shipped in ``gemma_nb/configs`` (sources: configs/SOURCES.md)."""
    raw = json.loads(Path(path).read_text())
    check_gemma4_pitfalls(raw)
    return load_config(raw)


# --------------------------------------------------------------------------------------------
# Inventory: build on the meta device, classify every unique parameter
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamRecord:
    """One unique parameter (or persistent buffer) and how TP would split it.

    ``split``: ``"out"`` (column-parallel: output rows divided), ``"in"`` (row-parallel: input
    columns divided, per-row scales stay whole), ``"experts"`` (leading expert axis divided),
    ``"kv"`` (k/v projections: KV heads divided, or replicated to 1 head per rank when TP exceeds
    them), ``"none"`` (never split). ``kv_heads`` / ``head_dim`` are set for ``"kv"`` records.
    """

    name: str
    group: str
    shape: tuple[int, ...]
    split: str
    is_buffer: bool = False
    kv_heads: int = 0
    head_dim: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class AttentionLayer:
    """What one decoder layer's attention stores in the KV cache."""

    layer_type: str | None
    q_heads: int
    kv_heads: int  # heads this layer writes to the cache (0: reuses another layer's cache)
    head_dim: int
    sliding_window: int | None
    latent_dim: int = 0  # MLA: values per token cached as one compressed latent, whole on every rank


@dataclass(frozen=True)
class ModelFacts:
    """Everything the planner needs from one meta-device build, kept after the model is dropped."""

    model_class: str
    records: tuple[ParamRecord, ...]
    tied: bool
    lm_head_shape: tuple[int, ...] | None
    attention_layers: tuple[AttentionLayer, ...]
    num_experts: int
    top_k: int


_ATTENTION_PARTS = {"self_attn", "attention", "attn", "self_attention", "cross_attn", "mixer"}
_MLP_PARTS = {"mlp", "feed_forward", "ffn", "block_sparse_moe", "moe"}
_SHARED_EXPERT_PARTS = {"shared_expert", "shared_experts", "shared_mlp"}
_COLUMN_NAMES = {"q_proj", "qkv_proj", "c_attn", "query_key_value", "gate_proj", "up_proj", "gate_up_proj",
                 "w1", "w3", "fc1", "c_fc", "fc_in", "dense_h_to_4h", "query", "key", "value"}
_ROW_NAMES = {"o_proj", "out_proj", "dense", "c_proj", "down_proj", "w2", "fc2", "fc_out", "dense_4h_to_h"}
_KV_NAMES = {"k_proj", "v_proj"}
# MLA's down-projections to the shared latent: every rank computes the whole latent (not split).
_REPLICATED_NAMES = {"kv_a_proj_with_mqa", "q_a_proj"}


def _split_for(module_name: str, leaf: str, ndim: int) -> str:
    """TP split of a linear's weight or bias from the module's short name."""
    if module_name in _KV_NAMES:
        return "kv"
    if module_name in _REPLICATED_NAMES:
        return "none"
    if module_name in _ROW_NAMES:
        return "in" if leaf == "weight" and ndim >= 2 else "none"
    if module_name in _COLUMN_NAMES or ndim >= 2:
        return "out"
    return "none"


def _classify(name: str, owner, is_input_embedding: bool, is_output_embedding: bool, ndim: int) -> tuple[str, str]:
    """(group, split) of one parameter, from its dotted name and owning module's class."""
    parts = name.split(".")
    leaf, module_parts = parts[-1], parts[:-1]
    module_name = module_parts[-1] if module_parts else ""
    cls = type(owner).__name__
    if is_input_embedding:
        return "embeddings", "none"
    if is_output_embedding:
        return "lm_head", "out"
    if any("per_layer" in p for p in parts):
        return "per_layer_embeddings", "none"
    if "shared_expert_gate" in module_parts:
        return "router", "none"
    if any(p in _SHARED_EXPERT_PARTS for p in module_parts):
        return "shared_mlp", _split_for(module_name, leaf, ndim)
    if "experts" in module_parts or cls.endswith("Experts"):
        return "experts", "experts" if ndim >= 3 else _split_for(module_name, leaf, ndim)
    if ("Router" in cls or "TopK" in cls or cls.endswith("Gate") or "router" in module_parts
            or module_name == "gate" or leaf == "e_score_correction_bias"):
        return "router", "none"
    if "Norm" in cls or module_name.endswith(("norm", "layernorm", "ln_f")) or module_name.startswith("ln_"):
        return "norms", "none"
    if any(p in _ATTENTION_PARTS for p in module_parts) or "Attention" in cls:
        return "attention", _split_for(module_name, leaf, ndim)
    if any(p in _MLP_PARTS for p in module_parts) or "MLP" in cls:
        return "shared_mlp", _split_for(module_name, leaf, ndim)
    return "other", "none"


def check_causal_lm_config(config) -> None:
    """Raise ValueError unless ``config`` is a decoder-only causal-LM text config transformers can build."""
    from transformers import PretrainedConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if not isinstance(config, PretrainedConfig):
        raise ValueError(
            f"config of type {type(config).__name__} is not a transformers PretrainedConfig; "
            "pass e.g. load_gemma4_26b_config() or transformers.MixtralConfig(...)"
        )
    model_type = getattr(config, "model_type", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config:
        raise ValueError(
            f"config {type(config).__name__} (model_type {model_type!r}) is multimodal; "
            "pass its language model's config: config.get_text_config()"
        )
    if getattr(config, "is_encoder_decoder", False) or model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise ValueError(
            f"config {type(config).__name__} (model_type {model_type!r}) is an encoder or encoder-decoder model; "
            "the planner handles decoder-only causal LMs (Gemma-4 text, Mixtral, Qwen3-MoE, Llama, ...)"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"config {type(config).__name__} (model_type {model_type!r}) has no causal-LM class in transformers "
            "(AutoModelForCausalLM); pass a decoder-only language model config"
        )


def _attention_layers(model, config) -> tuple[AttentionLayer, ...]:
    """Per-layer KV geometry read off the built modules (handles Gemma-4's per-layer head_dim/KV heads)."""
    from torch import nn

    if getattr(config, "kv_lora_rank", None):
        return _mla_layers(config)
    layers = []
    for _, mod in model.named_modules():
        q_proj = getattr(mod, "q_proj", None)
        if not isinstance(q_proj, nn.Linear):
            continue
        k_proj = getattr(mod, "k_proj", None)
        head_dim = getattr(mod, "head_dim", None) or getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        kv_heads = k_proj.out_features // head_dim if isinstance(k_proj, nn.Linear) else 0
        window = getattr(mod, "sliding_window", None)
        layers.append(AttentionLayer(getattr(mod, "layer_type", None), q_proj.out_features // head_dim,
                                     kv_heads, head_dim, window if isinstance(window, int) else None))
    if layers:
        return tuple(layers)
    # No q_proj/k_proj modules (fused-QKV architectures): fall back to the config's uniform geometry.
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return tuple(AttentionLayer(None, heads, kv, head_dim, None) for _ in range(config.num_hidden_layers))


def _mla_layers(config) -> tuple[AttentionLayer, ...]:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent of ``kv_lora_rank``
    plus the shared rope key (``qk_rope_head_dim``) per layer per token, as vLLM and SGLang keep it."""
    head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    return tuple(AttentionLayer(None, config.num_attention_heads, 0, head_dim, None, latent)
                 for _ in range(config.num_hidden_layers))


def _moe_sizes(config, records: Iterable[ParamRecord]) -> tuple[int, int]:
    """(num_experts, top_k) from the config's field names across MoE families; (0, 0) when dense."""
    experts = next((r.shape[0] for r in records if r.group == "experts" and len(r.shape) >= 3), 0)
    if not experts:
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    top_k = getattr(config, "top_k_experts", None) or getattr(config, "num_experts_per_tok", None) or 0
    return int(experts or 0), int(top_k or 0)


_FACTS_CACHE: dict[str, ModelFacts] = {}


def _config_key(config) -> str:
    return f"{type(config).__module__}.{type(config).__name__}:{config.to_json_string(use_diff=False)}"


def model_facts(config) -> ModelFacts:
    """Build ``config``'s causal LM on the meta device once and record what the planner needs."""
    check_causal_lm_config(config)
    key = _config_key(config)
    if key in _FACTS_CACHE:
        return _FACTS_CACHE[key]

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    input_emb = model.get_input_embeddings()
    output_emb = model.get_output_embeddings()
    input_ids = {id(p) for p in input_emb.parameters()} if input_emb is not None else set()
    output_ids = {id(p) for p in output_emb.parameters()} if output_emb is not None else set()
    modules = dict(model.named_modules())

    records, seen = [], set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        owner = modules.get(name.rsplit(".", 1)[0], model)
        group, split = _classify(name, owner, id(param) in input_ids, id(param) in output_ids, param.dim())
        kv_heads = head_dim = 0
        if split == "kv":
            head_dim = getattr(modules.get(name.rsplit(".", 2)[0]), "head_dim", None) or 0
            if head_dim:
                kv_heads = param.shape[0] // head_dim
            else:
                split = "out"
        records.append(ParamRecord(name, group, tuple(param.shape), split, False, kv_heads, head_dim))
    for module_name, module in modules.items():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name in module._non_persistent_buffers_set:
                continue
            name = f"{module_name}.{buf_name}" if module_name else buf_name
            group, _ = _classify(name, module, False, False, buf.dim())
            records.append(ParamRecord(name, group, tuple(buf.shape), "none", True))

    tied = bool(output_ids) and output_ids <= input_ids
    lm_head_shape = tuple(output_emb.weight.shape) if output_emb is not None else None
    num_experts, top_k = _moe_sizes(config, records)
    facts = ModelFacts(type(model).__name__, tuple(records), tied, lm_head_shape,
                       _attention_layers(model, config), num_experts, top_k)
    del model
    if len(_FACTS_CACHE) > 32:
        _FACTS_CACHE.clear()
    _FACTS_CACHE[key] = facts
    return facts


def inventory(config):
    """Unique parameters per group, as a DataFrame (one row per group in ``GROUPS`` order).

    Columns: ``group``, ``params`` (unique parameter elements; tied weights once), ``tensors``,
    ``share_pct`` (of all parameters), ``share_non_embedding_pct`` (of parameters outside the
    embedding table and lm_head; blank for those two rows), ``buffers`` (persistent buffer
    elements, e.g. Gemma-4's ``layer_scalar``: in the state dict but not parameters, not in
    ``params``), ``tied`` (True on ``embeddings`` and ``lm_head`` when the head reuses the input
    table), ``note``. ``attrs`` holds ``model_class``, ``total_params``, ``tied``.
    """
    import pandas as pd

    facts = model_facts(config)
    params = {g: 0 for g in GROUPS}
    tensors = {g: 0 for g in GROUPS}
    buffers = {g: 0 for g in GROUPS}
    for rec in facts.records:
        if rec.is_buffer:
            buffers[rec.group] += rec.numel
        else:
            params[rec.group] += rec.numel
            tensors[rec.group] += 1
    total = sum(params.values())
    embedding_like = params["embeddings"] + params["lm_head"] + params["per_layer_embeddings"]
    non_embedding = total - embedding_like
    rows = []
    for g in GROUPS:
        note = ""
        if g == "lm_head" and facts.tied:
            note = "tied to the input embedding: counted once, under embeddings"
        elif g == "embeddings" and facts.tied:
            note = "also the lm_head weight (tied)"
        elif buffers[g]:
            note = "buffers: persistent, in the state dict, not parameters"
        rows.append(
            {
                "group": g,
                "params": params[g],
                "tensors": tensors[g],
                "share_pct": 100.0 * params[g] / total if total else 0.0,
                "share_non_embedding_pct": (None if g in ("embeddings", "lm_head", "per_layer_embeddings")
                                            else 100.0 * params[g] / non_embedding if non_embedding else 0.0),
                "buffers": buffers[g],
                "tied": facts.tied and g in ("embeddings", "lm_head"),
                "note": note,
            }
        )
    table = pd.DataFrame(rows)
    table.attrs.update({"model_class": facts.model_class, "total_params": total, "tied": facts.tied})
    return table


def param_summary(config) -> dict:
    """Headline counts: total, per group, active per token, and the experts' share two ways.

    ``active_params`` = everything but the routed experts + top_k / E of the experts (the model card's
    convention: the embedding table counts as active). ``active_params_excl_embeddings`` drops the
    input table (and an untied lm_head).
    """
    inv = inventory(config).set_index("group")
    facts = model_facts(config)
    total = int(inv["params"].sum())
    experts = int(inv.loc["experts", "params"])
    embeddings = int(inv.loc["embeddings", "params"] + inv.loc["lm_head", "params"]
                     + inv.loc["per_layer_embeddings", "params"])
    routed_active = experts * facts.top_k // facts.num_experts if facts.num_experts else experts
    active = total - experts + routed_active
    return {
        "total_params": total,
        **{f"{g}_params": int(inv.loc[g, "params"]) for g in GROUPS},
        "non_embedding_params": total - embeddings,
        "num_experts": facts.num_experts,
        "top_k": facts.top_k,
        "active_params": active,
        "active_params_excl_embeddings": active - embeddings,
        "experts_share_pct": 100.0 * experts / total if total else 0.0,
        "experts_share_non_embedding_pct": 100.0 * experts / (total - embeddings) if total > embeddings else 0.0,
        "persistent_buffer_elems": int(inv["buffers"].sum()),
        "tied": facts.tied,
    }


# --------------------------------------------------------------------------------------------
# Tensor parallelism
# --------------------------------------------------------------------------------------------


def _check_tp_int(tp) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be an integer >= 1 (the tensor-parallel degree: ranks = NeuronCores)")
    return tp


def tp_problem(config, tp: int) -> str | None:
    """Why ``tp`` cannot shard ``config`` (None if it can).

    Query heads must divide by ``tp``. KV heads must divide by ``tp`` (sharded) or divide ``tp``
    (replicated to one head per rank, as NxD does for GQA when TP exceeds the KV heads). Stacked
    experts must divide by ``tp`` (whole experts per rank).
    """
    _check_tp_int(tp)
    facts = model_facts(config)
    for layer in facts.attention_layers:
        if layer.q_heads % tp:
            return f"tp={tp} does not divide num_attention_heads={layer.q_heads}"
        if layer.kv_heads and layer.kv_heads % tp and tp % layer.kv_heads:
            kind = f" ({layer.layer_type} layers)" if layer.layer_type else ""
            return (f"tp={tp} neither divides nor is a multiple of num_key_value_heads={layer.kv_heads}{kind}, "
                    "so KV heads can be neither sharded nor replicated evenly")
    if facts.num_experts and facts.num_experts % tp:
        return f"tp={tp} does not divide num_experts={facts.num_experts}"
    return None


def valid_tp_degrees(config, max_tp: int = 64) -> list[int]:
    """Every TP degree up to ``max_tp`` that ``config`` can be sharded at."""
    return [tp for tp in range(1, max_tp + 1) if tp_problem(config, tp) is None]


def check_tp(config, tp) -> int:
    """Return ``tp`` or raise ValueError naming it, why, and the degrees that work."""
    _check_tp_int(tp)
    problem = tp_problem(config, tp)
    if problem:
        choices = ", ".join(str(t) for t in valid_tp_degrees(config, max(tp, 16)))
        raise ValueError(f"{problem}; choose one of {choices}")
    return tp


def _kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    return kv_heads // tp if kv_heads % tp == 0 else 1


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------


def kv_cache_bytes_per_token(config, tp: int = 1, dtype: str = "bf16") -> int:
    """KV-cache bytes per token per rank: sum over layers of 2 (K and V) x KV heads/rank x head_dim x bytes.

    Both K and V count on every layer that writes the cache, including Gemma-4's global layers with
    ``attention_k_eq_v`` (HF applies different norms to K and V, so both are stored). Layers that
    reuse another layer's cache (``num_kv_shared_layers``) add nothing. MLA layers (DeepSeek) cache
    their compressed latent instead, the same on every rank.
    """
    _check_plain(dtype, "KV cache")
    check_tp(config, tp)
    per_elem = FORMATS[dtype].element_bits // 8
    return sum(_layer_kv_values(layer, tp) * per_elem for layer in model_facts(config).attention_layers)


def _layer_kv_values(layer: AttentionLayer, tp: int) -> int:
    """Cached values per token per rank of one layer: K and V heads on this rank, or MLA's latent."""
    heads = 2 * _kv_heads_per_rank(layer.kv_heads, tp) * layer.head_dim if layer.kv_heads else 0
    return heads + layer.latent_dim


def kv_cache_bytes(config, tp: int = 1, context_len: int = 512, batch: int = 1, dtype: str = "bf16",
                   cap_sliding: bool = False) -> int:
    """KV-cache bytes per rank for ``batch`` sequences of ``context_len`` tokens.

    ``cap_sliding=False`` (default) sizes every layer for the whole context, as the port's static
    buffers did; ``True`` caps sliding-window layers at their window (a rolling cache).
    """
    _check_context(context_len, batch)
    _check_plain(dtype, "KV cache")
    check_tp(config, tp)
    per_elem = FORMATS[dtype].element_bits // 8
    total = 0
    for layer in model_facts(config).attention_layers:
        tokens = min(context_len, layer.sliding_window) if cap_sliding and layer.sliding_window else context_len
        total += _layer_kv_values(layer, tp) * per_elem * tokens
    return total * batch


def _check_plain(dtype: str, what: str) -> None:
    get_format(dtype)
    if dtype not in PLAIN_DTYPES:
        raise ValueError(f"{what} dtype {dtype!r} must be one of {', '.join(PLAIN_DTYPES)}")


def _check_context(context_len, batch) -> None:
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 0:
        raise ValueError(f"context_len={context_len!r} must be an integer >= 0 (tokens held in the KV cache)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be an integer >= 1 (sequences decoded together)")


# --------------------------------------------------------------------------------------------
# Schemes and plans
# --------------------------------------------------------------------------------------------

# Runtime allowance default: the smallest non-weight HBM the Neuron runtime takes on a core that
# runs a compiled model, from the Neuron docs' "Neuron device memory" page (neuron-runtime/explore/
# device-memory.rst, aws-neuron/aws-neuron-sdk): a 96 MB micro-code overhead per physical
# NeuronCore ("model code") plus one shared-scratchpad page (default NEURON_SCRATCHPAD_PAGE_SIZE,
# 512 MB). A real NEFF's scratchpad is set by the compiler and is often several pages, plus I/O
# tensors, DMA rings and collectives buffers: this is a floor, not an estimate of the port's usage.
RUNTIME_MICROCODE_BYTES = 96 * 2**20
SCRATCHPAD_PAGE_BYTES = 512 * 2**20
DEFAULT_RUNTIME_ALLOWANCE_BYTES = RUNTIME_MICROCODE_BYTES + SCRATCHPAD_PAGE_BYTES

SHIPPED_CONTEXT_LEN = 512  # the port's compiled MAX / bucket 512 / 128 (docs/sources.md: port-recipe)


@dataclass(frozen=True)
class Scheme:
    """A placement: dtype per group, what TP shards, where the embedding and lm_head live.

    ``dtypes``: group -> format name (``FORMATS``); groups not listed use ``default_dtype``.
    Quantized formats apply to matrices; vectors in a quantized group (norm weights, biases, the
    router's scales) are stored in ``default_dtype``.
    ``sharded``: groups split across the TP ranks (subset of ``SHARDABLE_GROUPS``); others replicated.
    ``lm_head_sharded``: vocab-parallel head (ColumnParallel, gather_output=True) vs a full copy per rank.
    A tied head on the device is its own copy of the embedding table (a separate device parameter).
    ``embedding_on_device``: False = looked up on the host (the port's slim deploy), 0 HBM.
    ``kv_dtype``: the KV cache's dtype; the port's static KV buffers were fp32 (docs/sources.md: port-recipe).
    ``runtime_allowance_bytes``: explicit per-core allowance for runtime buffers (see
    ``DEFAULT_RUNTIME_ALLOWANCE_BYTES``: a documented floor).
    """

    name: str
    description: str = ""
    dtypes: Mapping[str, str] = field(default_factory=dict, hash=False)
    default_dtype: str = "bf16"
    sharded: frozenset[str] = frozenset(SHARDABLE_GROUPS)
    lm_head_sharded: bool = False
    embedding_on_device: bool = False
    kv_dtype: str = "fp32"
    runtime_allowance_bytes: int = DEFAULT_RUNTIME_ALLOWANCE_BYTES

    def __post_init__(self):
        object.__setattr__(self, "dtypes", dict(self.dtypes))
        object.__setattr__(self, "sharded", frozenset(self.sharded))
        for group, dtype in self.dtypes.items():
            if group not in GROUPS:
                raise ValueError(f"scheme {self.name!r}: group {group!r} is not one of {', '.join(GROUPS)}")
            get_format(dtype)
        _check_plain(self.default_dtype, f"scheme {self.name!r} default")
        _check_plain(self.kv_dtype, f"scheme {self.name!r} KV cache")
        bad = sorted(self.sharded - set(SHARDABLE_GROUPS))
        if bad:
            raise ValueError(f"scheme {self.name!r}: cannot shard {', '.join(bad)}; "
                             f"shardable groups are {', '.join(SHARDABLE_GROUPS)} (lm_head: use lm_head_sharded)")
        if self.runtime_allowance_bytes < 0:
            raise ValueError(f"scheme {self.name!r}: runtime_allowance_bytes={self.runtime_allowance_bytes} "
                             "must be >= 0")

    def dtype(self, group: str) -> str:
        return self.dtypes.get(group, self.default_dtype)

    def with_allowance(self, runtime_allowance_bytes: int) -> Scheme:
        return replace(self, runtime_allowance_bytes=int(runtime_allowance_bytes))


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("bf16", "everything bf16; lm_head replicated on each rank (the naive TP=2 port)"),
        Scheme("int8_experts", "int8 experts, rest bf16, lm_head replicated bf16 (the story's first attempt)",
               {"experts": "int8"}),
        Scheme("int8_experts_lm_head", "int8 experts + lm_head int8 sharded across ranks; shared MLP bf16",
               {"experts": "int8", "lm_head": "int8"}, lm_head_sharded=True),
        Scheme("int8_experts_shared_mlp", "int8 experts and shared dense MLP; lm_head replicated bf16",
               {"experts": "int8", "shared_mlp": "int8"}),
        Scheme("int8_squeeze", "int8 experts + shared MLP + lm_head sharded int8 (the shipped build)",
               {"experts": "int8", "shared_mlp": "int8", "lm_head": "int8"}, lm_head_sharded=True),
        Scheme("fp8_experts", "fp8 e4m3 experts (per-channel), rest bf16, lm_head replicated bf16",
               {"experts": "fp8"}),
        Scheme("mxfp4_experts", "MXFP4 experts, rest bf16, lm_head replicated bf16 (not loadable on NxD)",
               {"experts": "mxfp4"}),
        Scheme("nvfp4_experts", "NVFP4 experts, rest bf16, lm_head replicated bf16 (not loadable on NxD)",
               {"experts": "nvfp4"}),
    )
}


def get_scheme(scheme: str | Scheme) -> Scheme:
    """A named scheme from ``SCHEMES`` (or a ``Scheme`` passed through)."""
    if isinstance(scheme, Scheme):
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {', '.join(SCHEMES)}; or build a Scheme(...)")
    return SCHEMES[scheme]


def _rank_shape(rec: ParamRecord, tp: int) -> tuple[int, ...]:
    """The shape of the slice of ``rec`` one rank holds when its group is sharded ``tp`` ways."""
    shape = list(rec.shape)
    if tp == 1 or rec.split == "none" or not shape:
        return tuple(shape)
    if rec.split == "experts":
        shape[0] = -(-shape[0] // tp)
    elif rec.split == "kv":
        shape[0] = _kv_heads_per_rank(rec.kv_heads, tp) * rec.head_dim
    elif rec.split == "out":
        shape[-2 if len(shape) >= 2 else 0] = -(-shape[-2 if len(shape) >= 2 else 0] // tp)
    elif rec.split == "in":
        shape[-1] = -(-shape[-1] // tp)
    return tuple(shape)


def _record_bytes(rec: ParamRecord, dtype: str, default_dtype: str, tp: int) -> int:
    shape = _rank_shape(rec, tp)
    use = dtype if (len(shape) >= 2 and not rec.is_buffer) else (dtype if dtype in PLAIN_DTYPES else default_dtype)
    return tensor_bytes(shape, use)


@dataclass(frozen=True)
class Plan:
    """Bytes per rank for one (model, TP degree, scheme, context). ``table``: one row per group."""

    model_class: str
    scheme: Scheme
    tp: int
    context_len: int
    batch: int
    table: Any  # pandas DataFrame

    @property
    def total_bytes(self) -> int:
        return int(self.table["bytes_per_rank"].sum())

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    def bytes(self, group: str) -> int:
        """Bytes per rank of one row (a group, ``kv_cache`` or ``runtime_allowance``)."""
        if group not in PLAN_ROWS:
            raise ValueError(f"group {group!r} is not one of {', '.join(PLAN_ROWS)}")
        return int(self.table.set_index("group").loc[group, "bytes_per_rank"])

    def gb(self, group: str) -> float:
        return self.bytes(group) / GB

    @property
    def weights_bytes(self) -> int:
        """Bytes per rank of parameters and buffers only (no KV cache, no runtime allowance)."""
        return sum(self.bytes(g) for g in GROUPS)

    def _repr_html_(self):
        return self.table._repr_html_()


def plan(config, tp: int = 2, scheme: str | Scheme = "int8_squeeze", context_len: int = SHIPPED_CONTEXT_LEN,
         batch: int = 1, runtime_allowance_bytes: int | None = None) -> Plan:
    """Bytes per rank per group for ``scheme`` at TP degree ``tp`` with a KV cache of ``context_len`` tokens.

    Table columns: ``group``, ``dtype``, ``placement`` (``sharded``/``replicated``/``host``/``per rank``),
    ``params`` (whole-model elements in the group), ``bytes_per_rank`` (HBM of one rank),
    ``gb_per_rank``, ``host_bytes`` (what sits on the host instead, e.g. the host embedding table),
    ``detail``. The last two rows are ``kv_cache`` and ``runtime_allowance`` (an explicit, labelled
    allowance: ``runtime_allowance_bytes`` overrides the scheme's).
    """
    import pandas as pd

    sch = get_scheme(scheme)
    _check_tp_int(tp)
    _check_context(context_len, batch)
    facts = model_facts(config)
    check_tp(config, tp)
    if runtime_allowance_bytes is not None:
        sch = sch.with_allowance(runtime_allowance_bytes)

    per_group, head_detail = _group_bytes(facts, sch, tp)
    rows = _group_rows(per_group, sch, tp, head_detail) + _kv_and_allowance_rows(config, sch, tp, context_len, batch)
    table = pd.DataFrame(rows)
    table["gb_per_rank"] = table["bytes_per_rank"] / GB
    table = table[["group", "dtype", "placement", "params", "bytes_per_rank", "gb_per_rank", "host_bytes", "detail"]]
    return Plan(facts.model_class, sch, tp, context_len, batch, table)


def _group_bytes(facts, sch: Scheme, tp: int) -> tuple[dict[str, dict[str, int]], str]:
    """Per group: whole-model ``params``, HBM ``bytes`` of one rank and ``host`` bytes; and the lm_head's detail."""
    per_group = {g: {"params": 0, "bytes": 0, "host": 0} for g in GROUPS}
    for rec in facts.records:
        group = rec.group
        dtype = sch.dtype(group)
        entry = per_group[group]
        if not rec.is_buffer:
            entry["params"] += rec.numel
        on_host = group in ("embeddings", "per_layer_embeddings") and not sch.embedding_on_device
        if on_host:
            entry["host"] += _record_bytes(rec, dtype, sch.default_dtype, 1)
            continue
        if group == "lm_head":
            ranks = tp if sch.lm_head_sharded else 1
        else:
            ranks = tp if group in sch.sharded else 1
        entry["bytes"] += _record_bytes(rec, dtype, sch.default_dtype, ranks)

    head_detail = ""
    if facts.tied and facts.lm_head_shape is not None:
        # Tied: the inventory counts the table once (under embeddings), but on the device the head
        # is its own parameter (ColumnParallel linear loaded from embed_tokens.weight).
        head = ParamRecord("lm_head.weight (tied copy)", "lm_head", facts.lm_head_shape, "out")
        ranks = tp if sch.lm_head_sharded else 1
        per_group["lm_head"]["bytes"] += _record_bytes(head, sch.dtype("lm_head"), sch.default_dtype, ranks)
        head_detail = "tied: a device copy of the embedding table; "
    return per_group, head_detail


def _group_rows(per_group, sch: Scheme, tp: int, head_detail: str) -> list[dict]:
    """The plan's table rows for the weight groups: placement, dtype, bytes and a detail each."""
    rows = []
    for g in GROUPS:
        entry = per_group[g]
        if g in ("embeddings", "per_layer_embeddings") and not sch.embedding_on_device:
            placement = "host"
        elif g == "lm_head":
            placement = "sharded" if sch.lm_head_sharded and tp > 1 else "replicated"
        else:
            placement = "sharded" if g in sch.sharded and tp > 1 else "replicated"
        detail = ""
        if g == "lm_head":
            detail = head_detail + ("vocab-parallel" if sch.lm_head_sharded else "full copy per rank")
        if g in ("embeddings", "per_layer_embeddings") and placement == "host":
            detail = "looked up on the host; 0 HBM"
        rows.append({"group": g, "dtype": sch.dtype(g), "placement": placement, "params": entry["params"],
                     "bytes_per_rank": entry["bytes"], "host_bytes": entry["host"], "detail": detail})
    return rows


def _kv_and_allowance_rows(config, sch: Scheme, tp: int, context_len: int, batch: int) -> list[dict]:
    """The plan's last two rows: the KV cache and the runtime allowance."""
    rows = []
    kv = kv_cache_bytes(config, tp, context_len, batch, sch.kv_dtype)
    rows.append({"group": "kv_cache", "dtype": sch.kv_dtype, "placement": "sharded" if tp > 1 else "replicated",
                 "params": 0, "bytes_per_rank": kv, "host_bytes": 0,
                 "detail": f"K and V, {context_len} tokens x batch {batch}"})
    rows.append({"group": "runtime_allowance", "dtype": "-", "placement": "per rank", "params": 0,
                 "bytes_per_rank": int(sch.runtime_allowance_bytes), "host_bytes": 0,
                 "detail": ("default floor: 96 MiB micro-code + one 512 MiB scratchpad page"
                            if sch.runtime_allowance_bytes == DEFAULT_RUNTIME_ALLOWANCE_BYTES
                            else "allowance for runtime buffers (set by caller)")})
    return rows


def plans_table(plans: Iterable[Plan]):
    """GB per rank, one row per plan row (group / kv_cache / runtime_allowance), one column per scheme."""
    import pandas as pd

    columns = {p.scheme.name: p.table.set_index("group")["gb_per_rank"] for p in plans}
    table = pd.DataFrame(columns)
    table.loc["total"] = table.sum()
    table.index.name = "gb_per_rank"
    return table


def allowance_window(config, failing: str | Scheme = "int8_experts", fitting: str | Scheme = "int8_squeeze",
                     tp: int = 2, context_len: int = SHIPPED_CONTEXT_LEN, budget_bytes: int = 16 * GiB,
                     short_by_bytes: int | None = None) -> dict:
    """Which runtime allowance makes ``failing`` not fit and ``fitting`` fit, per core of ``budget_bytes``.

    Returns bytes: ``failing_static`` / ``fitting_static`` (weights + KV, no allowance),
    ``min_to_fail`` (an allowance above this makes ``failing`` overflow), ``max_to_fit`` (at or
    below this ``fitting`` still fits). ``min_to_fail < allowance <= max_to_fit`` reproduces both outcomes.
    With ``short_by_bytes`` (a what-if: "``failing`` was short by this much"), also
    ``allowance_if_short_by`` (the allowance that makes it so) and ``fitting_overflow_then`` (how
    far ``fitting`` would overflow under that same allowance; negative: it fits).
    """
    failing_static = plan(config, tp, failing, context_len, runtime_allowance_bytes=0).total_bytes
    fitting_static = plan(config, tp, fitting, context_len, runtime_allowance_bytes=0).total_bytes
    window = {
        "budget_bytes": int(budget_bytes),
        "failing_static_bytes": failing_static,
        "fitting_static_bytes": fitting_static,
        "min_to_fail_bytes": int(budget_bytes) - failing_static,
        "max_to_fit_bytes": int(budget_bytes) - fitting_static,
    }
    if short_by_bytes is not None:
        allowance = int(budget_bytes) + int(short_by_bytes) - failing_static
        window["allowance_if_short_by_bytes"] = allowance
        window["fitting_overflow_then_bytes"] = fitting_static + allowance - int(budget_bytes)
    return window


@dataclass(frozen=True)
class RuntimeAllowance:
    """HBM per NeuronCore the Neuron runtime takes besides weights and KV cache: a window or one value.

    ``low_bytes < allowance <= high_bytes`` (the window notebook 01 infers), or ``low == high``
    (a value the caller gave). A plan that fits with ``high_bytes`` fits whatever the runtime took
    inside the window; one that fails with ``low_bytes`` fails whatever it took.
    """

    low_bytes: int
    high_bytes: int
    source: str

    @property
    def is_window(self) -> bool:
        return self.low_bytes != self.high_bytes


def inferred_runtime_allowance(budget_bytes: int = 16 * GiB) -> RuntimeAllowance:
    """The runtime allowance that reproduces the port's two builds on a 16 GiB core (notebook 01).

    ``allowance_window`` of the 26B at TP=2 with its 512-token fp32 KV cache: the int8-experts
    build must fail (allowance above ``min_to_fail``) and the int8 squeeze must fit (at most
    ``max_to_fit``). ``python -m gemma_nb plan`` assumes this window for every model.
    """
    key = int(budget_bytes)
    if key not in _INFERRED:
        window = allowance_window(load_gemma4_26b_config(), "int8_experts", "int8_squeeze", 2, SHIPPED_CONTEXT_LEN,
                                  budget_bytes=key)
        _INFERRED[key] = RuntimeAllowance(window["min_to_fail_bytes"], window["max_to_fit_bytes"],
                                          "inferred from the port's failed int8-experts and fitting int8-squeeze builds "
                                          "(notebook 01)")
    return _INFERRED[key]


_INFERRED: dict[int, RuntimeAllowance] = {}


def given_runtime_allowance(gb: float) -> RuntimeAllowance:
    """One allowance, in GB (10^9 bytes) per NeuronCore; ValueError unless a finite number >= 0."""
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not math.isfinite(gb) or gb < 0:
        raise ValueError(f"runtime allowance {gb!r} GB must be a number >= 0 (GB per NeuronCore, e.g. 3.2)")
    return RuntimeAllowance(int(gb * GB), int(gb * GB), "given")


def largest_tp(config, neuron_cores: int) -> int:
    """The largest valid TP degree that fits in ``neuron_cores`` (one rank per core)."""
    return max(t for t in valid_tp_degrees(config, neuron_cores))


def fit_table(config, schemes: Iterable[str | Scheme] = tuple(SCHEMES), instances: Iterable[str] = tuple(INSTANCES),
              context_len: int = SHIPPED_CONTEXT_LEN, budget: str = "spec", tp: int | None = None):
    """Instance x scheme: headroom per NeuronCore at ``tp`` (default: the largest valid TP each instance allows)."""
    import pandas as pd

    rows = []
    for name in instances:
        inst = get_instance(name)
        degree = tp if tp is not None else largest_tp(config, inst.neuron_cores)
        for scheme in schemes:
            fit = fits(plan(config, degree, scheme, context_len), inst, budget)
            rows.append({"instance": inst.name, "scheme": get_scheme(scheme).name, "tp": degree,
                         "used_gb": fit.used_bytes / GB, "budget_gb": fit.budget_bytes / GB,
                         "headroom_gb": fit.headroom_gb, "fits": fit.fits, "usd_per_hour": inst.usd_per_hour})
    return pd.DataFrame(rows)
