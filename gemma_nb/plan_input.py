"""What ``python -m gemma_nb plan`` reads from a ``config.json``, checked without torch
(``read_raw_config``), and a note per field whose effect the byte plan does not follow exactly."""

import argparse
import json
import re
from collections import namedtuple
from pathlib import Path

# A config as the planner sees it: the text model's config, the towers' parameters left out, the
# notes.
PlanInput = namedtuple("PlanInput", "config towers_params notes")
# A config.json as read: its name as given, and its JSON object.
RawConfig = namedtuple("RawConfig", "name raw")
# Fields that hold sizes and counts: integers (or lists of them, per layer), never text.
COUNT_FIELD = re.compile(r"^(num_|n_|top_k)|(_size|_dim|_heads|_layers|_experts|_per_tok)$")
NONZERO_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
MAX_COUNT = 2**31 - 1
MAX_LAYERS = 4096  # the planner builds every layer (on torch's meta device: ~0.1 MB of RAM each)
MAX_CONFIG_BYTES = 1 << 24  # 16 MiB: a config.json is a few KB; a weights file is not one


class ConfigError(ValueError, argparse.ArgumentTypeError):
    """A config.json the planner cannot read; as an argparse type's error, argparse shows it."""


def read_raw_config(path: str | Path) -> RawConfig:
    """The JSON object at ``path`` (a file, or a folder's config.json) with its counts checked;
    ValueError naming the file, the field and what to pass."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(
            f"no config file at {str(path)!r}: pass a config.json or a model folder holding one "
            "(no weights needed; e.g. gemma_nb/configs/gemma4_26b_a4b.json)"
        )
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{file.name} is {file.stat().st_size:,} bytes, not a config.json (a few KB): pass "
            "the model folder or its config.json"
        )
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{file.name} is not UTF-8 text (byte {error.start}): pass a Hugging Face config.json"
        ) from None
    except (json.JSONDecodeError, RecursionError) as error:
        raise ConfigError(
            f"{file.name} is not JSON ({error}): pass a Hugging Face config.json"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{file.name} holds a JSON {type(raw).__name__}, not an object: pass a Hugging Face "
            "config.json, an object with a model_type key (e.g. "
            "gemma_nb/configs/gemma4_26b_a4b.json)"
        )
    for where, section in (("", raw), ("text_config.", raw.get("text_config"))):
        for key, value in (section if isinstance(section, dict) else {}).items():
            if COUNT_FIELD.search(key):
                most = MAX_LAYERS if key == "num_hidden_layers" else MAX_COUNT
                _check_count(f"{file.name}: {where}{key}", value, key in NONZERO_FIELDS, most)
    return RawConfig(path.name, raw)


def _check_count(name: str, value, nonzero: bool, most: int) -> None:
    least = int(nonzero)
    values = value if isinstance(value, list) else [value]
    if value is not None and not all(type(v) is int and least <= v <= most for v in values):
        raise ConfigError(
            f"{name} is {value!r:.60}: a size or count is a JSON integer from {least} to "
            f'{most} (e.g. 4096, not "4096" or -4096); fix the config'
        )


def mla_notes(config) -> list[str]:
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


def quantization_notes(raw: dict) -> list[str]:
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
