"""What ``python -m gemma_nb plan`` reads from a ``config.json``, and what it says it cannot model.

``read_config(path)`` loads a Hugging Face config (a file or a model folder; no weights) and
returns a ``PlanInput``: the causal-LM text config the planner counts, the parameters of any
multimodal towers it leaves out, and ``notes``, one per field whose effect the byte plan does not
follow exactly, each naming the field: multi-head latent attention (``kv_lora_rank``), a
checkpoint that ships quantized (``quantization_config``), vision or audio towers
(``vision_config``, ``audio_config``, ...). The planner prints every note: never a silent number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModel

from gemma_nb import memory


@dataclass(frozen=True)
class PlanInput:
    """A config as the planner sees it: ``config`` (text model), ``towers_params`` left out, ``notes``."""

    config: object
    raw: dict
    towers_params: int
    tower_fields: tuple[str, ...]
    notes: tuple[str, ...]


def config_path(path: str | Path) -> Path:
    """``path`` itself if it is a file, else ``path/config.json``; ValueError saying what to pass."""
    path = Path(path)
    candidate = path / "config.json" if path.is_dir() else path
    if not candidate.is_file():
        raise ValueError(f"no config file at {str(path)!r}: pass a config.json or a model folder holding one "
                         "(no weights needed; e.g. gemma_nb/configs/gemma4_26b_a4b.json)")
    return candidate


def read_raw(path: str | Path) -> dict:
    """The JSON object of a config file; ValueError for text that is not JSON or not an object."""
    file = config_path(path)
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file.name} is not JSON ({error}): pass a Hugging Face config.json") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file.name} holds a JSON {type(raw).__name__}, not an object: pass a Hugging Face "
                         "config.json, an object with a model_type key (e.g. gemma_nb/configs/gemma4_26b_a4b.json)")
    return raw


def read_config(path: str | Path) -> PlanInput:
    """The planner's view of the config at ``path``. Multimodal: its text model, towers counted apart.

    Refuses, with the fix, a file that is not a JSON object, has no ``model_type``, or is not a causal LM.
    """
    raw = read_raw(path)
    full = memory.load_config(raw)
    text = full.get_text_config() if hasattr(full, "get_text_config") else full
    memory.check_causal_lm_config(text)
    tower_fields = tuple(key for key, value in full.to_dict().items()
                         if key.endswith("_config") and key != "text_config" and isinstance(value, dict)) if text is not full else ()
    towers = towers_params(full, text) if text is not full else 0
    notes = [*_mla_notes(text), *_quantization_notes(raw), *_tower_notes(full, text, tower_fields, towers)]
    return PlanInput(text, raw, towers, tower_fields, tuple(notes))


def towers_params(full_config, text_config) -> int:
    """Parameters of a multimodal model outside its language model (vision, audio, projectors), on meta."""

    def count(config) -> int:
        with torch.device("meta"):
            model = AutoModel.from_config(config)
        return sum(p.numel() for p in model.parameters())

    return count(full_config) - count(text_config)


def _mla_notes(config) -> list[str]:
    rank = getattr(config, "kv_lora_rank", None)
    if not rank:
        return []
    rope, heads = config.qk_rope_head_dim, config.num_attention_heads
    full_kv = heads * (config.qk_nope_head_dim + rope + config.v_head_dim)
    return [f"kv_lora_rank={rank}: multi-head latent attention. The KV cache is counted as the compressed latent, "
            f"{rank} + qk_rope_head_dim {rope} = {rank + rope} values per layer per token, whole on every rank (as vLLM "
            f"and SGLang cache it); transformers' own cache stores full K and V per head, {full_kv} values "
            f"({full_kv / (rank + rope):.1f}x more). Attention FLOPs are approximated as {heads} heads of "
            f"{config.qk_nope_head_dim + rope}."]


def _quantization_notes(raw: dict) -> list[str]:
    found = [(where, section["quantization_config"]) for where, section in (("", raw), ("text_config.", raw.get("text_config")))
             if isinstance(section, dict) and isinstance(section.get("quantization_config"), dict)]
    notes = []
    for where, quant in found:
        method = quant.get("quant_method", "<no quant_method>")
        kept = quant.get("modules_to_not_convert")
        kept_words = f", modules_to_not_convert {kept}" if kept else ""
        notes.append(f"{where}quantization_config: the checkpoint ships {method!r} weights{kept_words}. The plan does not "
                     f"read that format: it counts every weight in the scheme's dtypes, as if dequantized to bf16 and "
                     f"quantized again (lossy twice); the checkpoint's own bytes are not modelled"
                     + (" (MXFP4 experts: --scheme mxfp4_experts, which NxD cannot load)" if method == "mxfp4" else "")
                     + ".")
    return notes


def _tower_notes(full, text, fields: tuple[str, ...], towers: int) -> list[str]:
    if text is full or not towers:
        return []
    names = ", ".join(fields) or "its non-text modules"
    return [f"{names}: a multimodal config ({type(full).__name__}). The plan is its language model "
            f"({type(text).__name__}) alone, as a text-only deploy loads it; the towers and projector, "
            f"{towers / 1e9:.3f}B parameters, are left out of every byte below and counted in params.towers."]
