"""A hub Gemma-4 checkpoint folder's text model for the neuron build: config and tensors, in
``Gemma4ForCausalLM``'s names."""

from pathlib import Path

from safetensors import safe_open
from transformers import AutoConfig

TEXT_PREFIXES = ("model.layers.", "model.norm.", "model.embed_tokens.", "lm_head.")


def text_key(key: str) -> str | None:
    """A checkpoint key in ``Gemma4ForCausalLM``'s names (``model.language_model.*`` ->
    ``model.*``), or None."""
    if key.startswith("model.language_model."):
        key = "model." + key.removeprefix("model.language_model.")
    return key if key.startswith(TEXT_PREFIXES) else None


def read_hf_state(model_dir: str | Path, only=None) -> dict:
    """The text tensors of a HF checkpoint folder in ``Gemma4ForCausalLM``'s names; ``only(name)``
    picks those read."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} holds no *.safetensors: expected the HF checkpoint folder of the model"
        )
    state, names = {}, set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                names.add(name := text_key(key))
                if name is not None and (only is None or only(name)):
                    state[name] = handle.get_tensor(key)
    if "model.embed_tokens.weight" not in names:
        raise ValueError(
            f"{model_dir}: no embed_tokens.weight among the text tensors; expected a Gemma-4 "
            "checkpoint"
        )
    return state


def text_config(model_dir: str | Path):  # of a checkpoint or artifact folder
    return AutoConfig.from_pretrained(str(model_dir)).get_text_config()
