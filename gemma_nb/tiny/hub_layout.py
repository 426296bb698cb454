"""The TP=2 checkpoint re-laid out, weights unchanged, as the hub stores Gemma-4-26B-A4B-it (for the 26B's own loader)."""

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"


def save_hub_layout(folder: str | Path, shards: int = 2) -> dict:
    """Rewrite ``folder``'s ``model.safetensors`` and ``config.json`` in place as the hub lays them out; returns the index."""
    folder = Path(folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert all(key.startswith("model.") for key in handle.keys()), "tensors not under model."
        tensors = {"model.language_model." + key.removeprefix("model."): handle.get_tensor(key) for key in handle.keys()}
        metadata = handle.metadata() or {}
    text_config = json.loads((folder / "config.json").read_text())
    names = sorted(tensors)
    files = [f"model-{n + 1:05d}-of-{shards:05d}.safetensors" for n in range(shards)]
    weight_map = {name: files[i * shards // len(names)] for i, name in enumerate(names)}
    for file in files:
        save_file({k: tensors[k].contiguous() for k in names if weight_map[k] == file}, str(folder / file), metadata)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
              "text_config": text_config, "transformers_version": text_config.get("transformers_version")}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "model.safetensors").unlink()
    return index
