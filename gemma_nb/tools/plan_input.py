"""What ``python -m gemma_nb plan`` reads from a ``config.json`` (``read_config``): the text config
it counts, the multimodal towers it leaves out, and a note per field whose effect the byte plan does
not follow exactly."""

import json
from collections import namedtuple
from pathlib import Path

import torch
from transformers import AutoModel

from gemma_nb import memory

# A config as the planner sees it: the text model's config, the towers' parameters left out, the
# notes.
PlanInput = namedtuple("PlanInput", "config towers_params notes")


def read_config(path: str | Path) -> PlanInput:
    """The planner's view of the config at ``path`` (a file, or a folder's config.json): a
    multimodal one's text model, its towers counted apart; ValueError saying what to pass."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"no config file at {str(path)!r}: pass a config.json or a model folder holding one "
            "(no weights needed; e.g. gemma_nb/configs/gemma4_26b_a4b.json)"
        )
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{file.name} is not JSON ({error}): pass a Hugging Face config.json"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"{file.name} holds a JSON {type(raw).__name__}, not an object: pass a Hugging Face "
            "config.json, an object with a model_type key (e.g. "
            "gemma_nb/configs/gemma4_26b_a4b.json)"
        )
    full = memory.load_config(raw)
    text = full.get_text_config()
    memory.check_causal_lm_config(text)
    notes = [*_mla_notes(text), *_quantization_notes(raw)]
    if text is full:
        return PlanInput(text, 0, tuple(notes))
    with torch.device("meta"):  # the towers: vision, audio, projectors
        towers = sum(p.numel() for p in AutoModel.from_config(full).parameters()) - sum(
            p.numel() for p in AutoModel.from_config(text).parameters()
        )
    if towers:
        names = ", ".join(
            key
            for key, value in full.to_dict().items()
            if key.endswith("_config") and key != "text_config" and isinstance(value, dict)
        )
        notes.append(
            f"{names or 'its non-text modules'}: a multimodal config ({type(full).__name__}). "
            f"The plan is its language model ({type(text).__name__}) alone, as a text-only "
            f"deploy loads it; the towers and projector, {towers / 1e9:.3f}B parameters, are "
            "left out of every byte below and counted in params.towers."
        )
    return PlanInput(text, towers, tuple(notes))


def _mla_notes(config) -> list[str]:
    rank = getattr(config, "kv_lora_rank", None)
    if not rank:
        return []
    rope, heads = config.qk_rope_head_dim, config.num_attention_heads
    full_kv = heads * (config.qk_nope_head_dim + rope + config.v_head_dim)
    return [
        f"kv_lora_rank={rank}: multi-head latent attention. The KV cache is counted as the "
        f"compressed latent, {rank} + qk_rope_head_dim {rope} = {rank + rope} values per layer "
        "per token, whole on every rank (as vLLM and SGLang cache it); transformers' own cache "
        f"stores full K and V per head, {full_kv} values ({full_kv / (rank + rope):.1f}x more). "
        f"Attention FLOPs are approximated as {heads} heads of {config.qk_nope_head_dim + rope}."
    ]


def _quantization_notes(raw: dict) -> list[str]:
    found = [
        (where, section["quantization_config"])
        for where, section in (("", raw), ("text_config.", raw.get("text_config")))
        if isinstance(section, dict) and isinstance(section.get("quantization_config"), dict)
    ]
    return [
        f"{where}quantization_config: the checkpoint ships "
        f"{quant.get('quant_method', '<no quant_method>')!r} weights"
        + (
            f", modules_to_not_convert {quant['modules_to_not_convert']}"
            if quant.get("modules_to_not_convert")
            else ""
        )
        + ". The plan does not read that format: it counts every weight in the scheme's dtypes, "
        "as if dequantized to bf16 and quantized again (lossy twice); the checkpoint's own "
        "bytes are not modelled"
        + (
            " (MXFP4 experts: --scheme mxfp4_experts, which NxD cannot load)"
            if quant.get("quant_method") == "mxfp4"
            else ""
        )
        + "."
        for where, quant in found
    ]
