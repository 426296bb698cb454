"""A checkpoint folder re-laid out as the hub stores Gemma-4-26B-A4B-it (multimodal config, prefixed names,
sharded files), weights unchanged: the TP=2 checkpoint is stored so, for the 26B's own loader."""

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"


def save_hub_layout(source: str | Path, target: str | Path, shards: int = 2) -> dict:
    """Write ``source``'s ``model.safetensors`` into ``target`` (may be ``source``) as the hub lays it out; returns the index."""
    source, target = Path(source), Path(target)
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        assert all(key.startswith("model.") for key in handle.keys()), "tensors not under model."
        tensors = {"model.language_model." + key.removeprefix("model."): handle.get_tensor(key) for key in handle.keys()}
        metadata = handle.metadata() or {}
    text_config = json.loads((source / "config.json").read_text())
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.name not in ("model.safetensors", "config.json") and source != target:
            shutil.copyfile(path, target / path.name)
    names = sorted(tensors)
    files = [f"model-{n + 1:05d}-of-{shards:05d}.safetensors" for n in range(shards)]
    weight_map = {name: files[i * shards // len(names)] for i, name in enumerate(names)}
    for file in files:
        save_file({k: tensors[k].contiguous() for k in names if weight_map[k] == file}, str(target / file), metadata)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}, "weight_map": weight_map}
    (target / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
              "text_config": text_config, "transformers_version": text_config.get("transformers_version")}
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if source == target:
        (source / "model.safetensors").unlink()
    return index

