"""Which model a notebook runs on (the bundled checkpoint, a local folder, a hub id) and loading it:
safetensors only, never ``trust_remote_code``; the hub token only from ``HF_TOKEN``, never
printed."""

import contextlib
import os
import re
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma4ForCausalLM
from transformers.utils import logging as hf_logging

from gemma_nb.tiny import BUNDLED_ID, BUNDLED_IDS

HF_TOKEN_ENV = "HF_TOKEN"
# owner/name as the hub spells it (no leading dot or slash, one slash).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HUB_HELP = (
    "pass a local folder holding config.json, model.safetensors and tokenizer.json as model_id, "
    f"or run where the hub is reachable (unset HF_HUB_OFFLINE; set {HF_TOKEN_ENV} for gated "
    "models)"
)


class ModelNotFoundError(ValueError):
    """A model_id that is neither a usable local folder nor a reachable hub id."""


def hf_token() -> str | None:
    return os.environ.get(HF_TOKEN_ENV) or None


def hub_offline() -> bool:  # HF_HUB_OFFLINE set to a true value
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _check_local_dir(folder: Path, model_id: str) -> Path:
    if not folder.exists():
        raise ModelNotFoundError(
            f"model_id {model_id!r}: no such folder {folder}; expected a folder holding "
            "config.json, model.safetensors and tokenizer.json (or a hub id such as "
            f"google/gemma-4-26B-A4B-it, or {BUNDLED_ID!r} for the bundled checkpoint)"
        )
    if not folder.is_dir():
        raise ModelNotFoundError(
            f"model_id {model_id!r}: {folder} is a file; expected a model folder holding "
            "config.json"
        )
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"model_id {model_id!r}: folder {folder} has no config.json; expected a checkpoint "
            "saved with save_pretrained (config.json, model.safetensors, tokenizer.json)"
        )
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"model_id {model_id!r}: folder {folder} has no *.safetensors weights; only "
            "safetensors are loaded (no pickled .bin files): convert the checkpoint with "
            "save_pretrained(safe_serialization=True)"
        )
    return folder


def resolve_model_id(model_id: str | os.PathLike) -> str:
    """What ``from_pretrained`` should be given for ``model_id``, checked (``ModelNotFoundError``
    naming the fix): a bundled id's folder, a local folder holding config.json and safetensors, or a
    hub id if the hub or the local hub cache has it."""
    if isinstance(model_id, os.PathLike):
        return str(_check_local_dir(Path(model_id), str(model_id)))
    if not isinstance(model_id, str) or not model_id.strip():
        raise ModelNotFoundError(
            f"model_id {model_id!r} must be a non-empty string: a local folder or a hub id"
        )
    if model_id in BUNDLED_IDS:
        return str(_check_local_dir(BUNDLED_IDS[model_id], model_id))
    looks_like_path = (
        model_id.startswith((".", "/", "~")) or model_id.count("/") != 1 or Path(model_id).exists()
    )
    if looks_like_path or not _HUB_ID.match(model_id):
        return str(_check_local_dir(Path(model_id).expanduser(), model_id))
    if hub_offline() and not isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        raise ModelNotFoundError(
            f"model_id {model_id!r} is a hub id, but HF_HUB_OFFLINE is set and it is not in the "
            f"local hub cache: {_HUB_HELP}"
        )
    return model_id


@contextlib.contextmanager
def quiet_loading():
    """No tqdm bars while loading: notebooks would store their frozen text."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_model(
    model_id: str | os.PathLike = BUNDLED_ID,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
):
    """(model, tokenizer) for ``model_id`` in ``dtype`` on ``device``, eval mode: the 26B's code
    path exactly."""
    source = resolve_model_id(model_id)
    is_local = Path(source).is_dir()
    token = None if is_local else hf_token()
    try:
        with quiet_loading():
            tokenizer = AutoTokenizer.from_pretrained(source, token=token, trust_remote_code=False)
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, token=token, use_safetensors=True, trust_remote_code=False
            )
    except OSError as error:
        if is_local:
            raise
        # The hub client's message may quote request headers; say what happened without it.
        raise ModelNotFoundError(
            f"could not load hub model {model_id!r} ({type(error).__name__}): {_HUB_HELP}"
        ) from None
    return model.to(device).eval(), tokenizer


def model_skeleton(config) -> nn.Module:
    """The model's structure on the meta device: every module, no weight memory."""
    with torch.device("meta"):
        return Gemma4ForCausalLM(config).eval()
