"""A causal LM's parameter inventory from its config (notebook 01): groups, TP splits, KV geometry,
TP checks."""

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from gemma_nb.formats import FORMATS, PLAIN_DTYPES, get_format

GEMMA4_26B_CONFIG_PATH = Path(__file__).resolve().parent / "configs" / "gemma4_26b_a4b.json"

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
EMBEDDING_GROUPS = ("embeddings", "lm_head", "per_layer_embeddings")


def load_config(config_dict: Mapping[str, Any]):
    """A transformers config from a ``config.json``'s dict, of the class its ``model_type`` key
    names."""
    raw = dict(config_dict)
    model_type = raw.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(
            f"config has no 'model_type' key naming a transformers model type (it holds "
            f"{model_type!r:.40}); add one (e.g. 'gemma4_text', 'mixtral', 'llama')"
        )
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model_type {model_type!r} is not known to this transformers version")
    try:
        return CONFIG_MAPPING[model_type].from_dict(raw)
    except (TypeError, ValueError, ArithmeticError, StrictDataclassError) as error:
        raise ValueError(f"transformers refuses this {model_type} config: {error}") from None


def check_gemma4_pitfalls(raw: Mapping[str, Any]) -> None:
    """ValueError if a Gemma-4 26B config dict leaves a field whose transformers default builds
    another model."""
    per_layer = raw.get("hidden_size_per_layer_input", "<missing: default 256>")
    if per_layer != 0:
        raise ValueError(
            f"hidden_size_per_layer_input={per_layer!r}: "
            "the 26B has no per-layer embeddings; set it to 0 (the transformers default 256 "
            "adds 2.08B params)"
        )
    if "attention_k_eq_v" not in raw:
        raise ValueError(
            "attention_k_eq_v is missing: the default False gives global layers a v_proj and 8 "
            "KV heads (+100.9M params); set attention_k_eq_v: true for Gemma-4-26B-A4B"
        )
    if raw.get("final_logit_softcapping") is None:
        raise ValueError(
            "final_logit_softcapping is missing or null: the default None leaves logits uncapped; "
            "set it to 30.0 for Gemma-4-26B-A4B"
        )


def load_gemma4_26b_config(path: str | Path = GEMMA4_26B_CONFIG_PATH):
    """The Gemma-4-26B-A4B text config shipped in ``gemma_nb/configs`` (sources:
    configs/SOURCES.md)."""
    raw = json.loads(Path(path).read_text())
    check_gemma4_pitfalls(raw)
    return load_config(raw)


class ParamRecord(NamedTuple):
    """One unique parameter (or persistent buffer) and how TP splits it: ``split`` divides its
    output rows (``"out"``), input columns (``"in"``), expert axis, KV heads (``"kv"``: one per rank
    past them) or nothing."""

    name: str
    group: str
    shape: tuple[int, ...]
    split: str
    is_buffer: bool = False
    kv_heads: int = 0
    head_dim: int = 0

    numel = property(lambda self: math.prod(self.shape))


class AttentionLayer(NamedTuple):
    """What one decoder layer's attention stores in the KV cache."""

    layer_type: str | None
    q_heads: int
    kv_heads: int  # heads this layer writes to the cache (0: reuses another layer's cache)
    head_dim: int
    sliding_window: int | None
    latent_dim: int = (
        0  # MLA: values per token cached as one compressed latent, whole on every rank
    )


class ModelFacts(NamedTuple):
    """What the planner needs from one meta-device build."""

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
_COLUMN_NAMES = {
    "q_proj",
    "qkv_proj",
    "c_attn",
    "query_key_value",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "w1",
    "w3",
    "fc1",
    "c_fc",
    "fc_in",
    "dense_h_to_4h",
    "query",
    "key",
    "value",
}
_ROW_NAMES = {
    "o_proj",
    "out_proj",
    "dense",
    "c_proj",
    "down_proj",
    "w2",
    "fc2",
    "fc_out",
    "dense_4h_to_h",
}
_KV_NAMES = {"k_proj", "v_proj"}
# MLA's down-projections to the shared latent: every rank computes the whole latent (not split).
_REPLICATED_NAMES = {"kv_a_proj_with_mqa", "q_a_proj"}


def _split_for(module_name: str, leaf: str, ndim: int) -> str:
    if module_name in _KV_NAMES:
        return "kv"
    if module_name in _ROW_NAMES:
        return "in" if leaf == "weight" and ndim >= 2 else "none"
    return (
        "out"
        if module_name not in _REPLICATED_NAMES and (module_name in _COLUMN_NAMES or ndim >= 2)
        else "none"
    )


def _classify(
    name: str, owner, is_input_embedding: bool, is_output_embedding: bool, ndim: int
) -> tuple[str, str]:
    """(group, split) of one parameter, from its dotted name and owning module's class."""
    *module_parts, leaf = parts = name.split(".")
    module_name, cls = module_parts[-1] if module_parts else "", type(owner).__name__
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
    if (
        "Router" in cls
        or "TopK" in cls
        or cls.endswith("Gate")
        or "router" in module_parts
        or module_name == "gate"
        or leaf == "e_score_correction_bias"
    ):
        return "router", "none"
    if (
        "Norm" in cls
        or module_name.endswith(("norm", "layernorm", "ln_f"))
        or module_name.startswith("ln_")
    ):
        return "norms", "none"
    if any(p in _ATTENTION_PARTS for p in module_parts) or "Attention" in cls:
        return "attention", _split_for(module_name, leaf, ndim)
    if any(p in _MLP_PARTS for p in module_parts) or "MLP" in cls:
        return "shared_mlp", _split_for(module_name, leaf, ndim)
    return "other", "none"


def check_causal_lm_config(config) -> None:
    """ValueError unless ``config`` is a decoder-only causal-LM text config transformers can
    build."""
    if not isinstance(config, PretrainedConfig):
        raise ValueError(
            f"config of type {type(config).__name__} is not a transformers PretrainedConfig; "
            "pass e.g. load_gemma4_26b_config() or transformers.MixtralConfig(...)"
        )
    model_type = getattr(config, "model_type", None)
    what = f"config {type(config).__name__} (model_type {model_type!r})"
    if hasattr(config, "get_text_config") and config.get_text_config() is not config:
        raise ValueError(
            f"{what} is multimodal; pass its language model's config: config.get_text_config()"
        )
    if (
        getattr(config, "is_encoder_decoder", False)
        or model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    ):
        raise ValueError(
            f"{what} is an encoder or encoder-decoder model; the planner handles decoder-only "
            "causal LMs (Gemma-4 text, Mixtral, Qwen3-MoE, Llama, ...)"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{what} has no causal-LM class in transformers (AutoModelForCausalLM); "
            "pass a decoder-only language model config"
        )


def _attention_layers(model, config) -> tuple[AttentionLayer, ...]:
    """Per-layer KV geometry read off the built modules (Gemma-4's head_dim and KV heads vary per
    layer)."""
    # MLA (DeepSeek): one latent plus the shared rope key per layer per token
    if getattr(config, "kv_lora_rank", None):
        head_dim, latent = (
            config.qk_nope_head_dim + config.qk_rope_head_dim,
            config.kv_lora_rank + config.qk_rope_head_dim,
        )
        return tuple(
            AttentionLayer(None, config.num_attention_heads, 0, head_dim, None, latent)
            for _ in range(config.num_hidden_layers)
        )
    layers = []
    for mod in model.modules():
        q_proj, k_proj = getattr(mod, "q_proj", None), getattr(mod, "k_proj", None)
        if not isinstance(q_proj, nn.Linear):
            continue
        head_dim = (
            getattr(mod, "head_dim", None)
            or getattr(config, "head_dim", None)
            or (config.hidden_size // config.num_attention_heads)
        )
        kv_heads = k_proj.out_features // head_dim if isinstance(k_proj, nn.Linear) else 0
        window = getattr(mod, "sliding_window", None)
        layers.append(
            AttentionLayer(
                getattr(mod, "layer_type", None),
                q_proj.out_features // head_dim,
                kv_heads,
                head_dim,
                window if isinstance(window, int) else None,
            )
        )
    if layers:
        return tuple(layers)
    # No q_proj/k_proj modules (fused-QKV architectures): fall back to the config's uniform
    # geometry.
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return tuple(
        AttentionLayer(None, heads, kv, head_dim, None) for _ in range(config.num_hidden_layers)
    )


_FACTS_CACHE: dict[str, ModelFacts] = {}


def _records(model, input_ids: set, output_ids: set) -> list[ParamRecord]:
    modules, records = dict(model.named_modules()), []
    for name, param in model.named_parameters():  # each tensor once, under its first name
        owner = modules.get(name.rsplit(".", 1)[0], model)
        group, split = _classify(
            name, owner, id(param) in input_ids, id(param) in output_ids, param.dim()
        )
        head_dim = (
            (getattr(modules.get(name.rsplit(".", 2)[0]), "head_dim", None) or 0)
            if split == "kv"
            else 0
        )
        # a KV projection without head_dim: split its rows
        split = "out" if split == "kv" and not head_dim else split
        kv_heads = param.shape[0] // head_dim if head_dim else 0
        records.append(
            ParamRecord(name, group, tuple(param.shape), split, False, kv_heads, head_dim)
        )
    for module_name, module in modules.items():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name not in module._non_persistent_buffers_set:
                name = f"{module_name}.{buf_name}" if module_name else buf_name
                group, _ = _classify(name, module, False, False, buf.dim())
                records.append(ParamRecord(name, group, tuple(buf.shape), "none", True))
    return records


def model_facts(config) -> ModelFacts:
    """Build ``config``'s causal LM on the meta device once and record what the planner needs."""
    check_causal_lm_config(config)
    key = (
        f"{type(config).__module__}.{type(config).__name__}:{config.to_json_string(use_diff=False)}"
    )
    if key in _FACTS_CACHE:
        return _FACTS_CACHE[key]
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (RuntimeError, TypeError, ValueError, ArithmeticError, IndexError, KeyError) as error:
        raise ValueError(
            f"transformers cannot build {type(config).__name__} from this config "
            f"({type(error).__name__}: {error}); check its sizes"
        ) from None
    input_emb, output_emb = model.get_input_embeddings(), model.get_output_embeddings()
    input_ids, output_ids = (
        {id(p) for p in emb.parameters()} if emb is not None else set()
        for emb in (input_emb, output_emb)
    )
    records = _records(model, input_ids, output_ids)
    # (num_experts, top_k): the stacked experts' axis, else the config's field names across MoE
    # families; 0 when dense
    experts = next((r.shape[0] for r in records if r.group == "experts" and len(r.shape) >= 3), 0)
    experts = (
        experts
        or getattr(config, "num_local_experts", None)
        or getattr(config, "num_experts", None)
        or 0
    )
    top_k = (
        getattr(config, "top_k_experts", None) or getattr(config, "num_experts_per_tok", None) or 0
    )
    if experts and not 1 <= top_k <= experts:
        raise ValueError(
            f"the config routes each token to {top_k} of {experts} experts: set "
            f"num_experts_per_tok (or top_k_experts) between 1 and {experts}"
        )
    facts = ModelFacts(
        type(model).__name__,
        tuple(records),
        bool(output_ids) and output_ids <= input_ids,
        tuple(output_emb.weight.shape) if output_emb is not None else None,
        _attention_layers(model, config),
        int(experts),
        int(top_k),
    )
    if len(_FACTS_CACHE) > 32:
        _FACTS_CACHE.clear()
    _FACTS_CACHE[key] = facts
    return facts


def inventory(config):
    """Parameters (tied once) and persistent buffer elements per group; ``attrs``: model_class,
    total_params, tied."""
    facts = model_facts(config)
    params, tensors, buffers = ({g: 0 for g in GROUPS} for _ in range(3))
    for rec in facts.records:
        (buffers if rec.is_buffer else params)[rec.group] += rec.numel
        tensors[rec.group] += 0 if rec.is_buffer else 1
    total = sum(params.values())
    non_embedding = total - sum(params[g] for g in EMBEDDING_GROUPS)
    rows = []
    for g in GROUPS:
        note = (
            "tied to the input embedding: counted once, under embeddings"
            if g == "lm_head" and facts.tied
            else "also the lm_head weight (tied)"
            if g == "embeddings" and facts.tied
            else "buffers: persistent, in the state dict, not parameters"
            if buffers[g]
            else ""
        )
        rows.append(
            {
                "group": g,
                "params": params[g],
                "tensors": tensors[g],
                "share_pct": 100.0 * params[g] / total if total else 0.0,
                "share_non_embedding_pct": (
                    None
                    if g in EMBEDDING_GROUPS
                    else 100.0 * params[g] / non_embedding
                    if non_embedding
                    else 0.0
                ),
                "buffers": buffers[g],
                "tied": facts.tied and g in ("embeddings", "lm_head"),
                "note": note,
            }
        )
    table = pd.DataFrame(rows)
    table.attrs.update(
        {"model_class": facts.model_class, "total_params": total, "tied": facts.tied}
    )
    return table


def param_summary(config) -> dict:
    """Headline counts: total, per group, active per token (embeddings count as active), the
    experts' share."""
    inv = inventory(config).set_index("group")
    facts = model_facts(config)
    total, experts = int(inv["params"].sum()), int(inv.loc["experts", "params"])
    embeddings = int(inv.loc[list(EMBEDDING_GROUPS), "params"].sum())
    active = (
        total
        - experts
        + (experts * facts.top_k // facts.num_experts if facts.num_experts else experts)
    )
    return {
        "total_params": total,
        **{f"{g}_params": int(inv.loc[g, "params"]) for g in GROUPS},
        "non_embedding_params": total - embeddings,
        "num_experts": facts.num_experts,
        "top_k": facts.top_k,
        "active_params": active,
        "active_params_excl_embeddings": active - embeddings,
        "experts_share_pct": 100.0 * experts / total if total else 0.0,
        "experts_share_non_embedding_pct": 100.0 * experts / (total - embeddings)
        if total > embeddings
        else 0.0,
        "persistent_buffer_elems": int(inv["buffers"].sum()),
        "tied": facts.tied,
    }


def tp_problem(config, tp: int, whole_experts: bool = True) -> str | None:
    """Why ``tp`` cannot shard ``config`` (None if it can): heads, KV heads (or tp % KV heads),
    experts (kept whole on a rank, as the port does) must divide."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(
            f"tp={tp!r} must be an integer >= 1 (the tensor-parallel degree: ranks = NeuronCores)"
        )
    facts = model_facts(config)
    for layer in facts.attention_layers:
        if layer.q_heads % tp:
            return f"tp={tp} does not divide num_attention_heads={layer.q_heads}"
        if layer.kv_heads and layer.kv_heads % tp and tp % layer.kv_heads:
            kind = f" ({layer.layer_type} layers)" if layer.layer_type else ""
            return (
                f"tp={tp} neither divides nor is a multiple of "
                f"num_key_value_heads={layer.kv_heads}{kind}, so KV heads can be neither sharded "
                "nor replicated evenly"
            )
    if whole_experts and facts.num_experts and facts.num_experts % tp:
        return f"tp={tp} does not divide num_experts={facts.num_experts}"
    return None


def valid_tp_degrees(config, max_tp: int = 64) -> list[int]:
    return [tp for tp in range(1, max_tp + 1) if tp_problem(config, tp) is None]


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    return kv_heads // tp if kv_heads % tp == 0 else 1


def kv_cache_bytes(
    config, tp: int = 1, context_len: int = 512, batch: int = 1, dtype: str = "bf16"
) -> int:
    """KV-cache bytes per rank for ``batch`` sequences of ``context_len`` tokens, sliding layers too
    (the port's static buffers)."""
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 0:
        raise ValueError(
            f"context_len={context_len!r} must be an integer >= 0 (tokens held in the KV cache)"
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r} must be an integer >= 1 (sequences decoded together)")
    check_plain(dtype, "KV cache")
    if problem := tp_problem(config, tp):
        raise ValueError(
            f"{problem}; choose one of "
            f"{', '.join(str(t) for t in valid_tp_degrees(config, max(tp, 16)))}"
        )
    per_elem, total = FORMATS[dtype].element_bits // 8, 0
    for layer in model_facts(config).attention_layers:
        heads = 2 * kv_heads_per_rank(layer.kv_heads, tp) * layer.head_dim if layer.kv_heads else 0
        total += (heads + layer.latent_dim) * per_elem
    return total * context_len * batch


def check_plain(dtype: str, what: str) -> None:
    get_format(dtype)
    assert dtype in PLAIN_DTYPES, f"{what} dtype {dtype!r} must be one of {', '.join(PLAIN_DTYPES)}"
