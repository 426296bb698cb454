"""gemma_nb.modelio: model_id resolution, clear errors, HF_TOKEN from the environment only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gemma_nb import modelio
from gemma_nb.modelio import BUNDLED_ID, ModelNotFoundError, hf_token, load_model, resolve_model_id
from gemma_nb.tiny import CHECKPOINT_DIR

FAKE_TOKEN = "hf_fakeTOKENforTESTSnotREAL0123456789"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


def test_bundled_id_resolves_to_the_checkpoint_folder():
    assert Path(resolve_model_id(BUNDLED_ID)) == CHECKPOINT_DIR
    assert resolve_model_id(CHECKPOINT_DIR) == str(CHECKPOINT_DIR)
    assert resolve_model_id(str(CHECKPOINT_DIR)) == str(CHECKPOINT_DIR)


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model.*config.json"):
        resolve_model_id(str(missing))
    with pytest.raises(ValueError, match="./relative/missing-model"):
        resolve_model_id("./relative/missing-model")


def test_folder_without_config_says_what_was_expected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(
        ModelNotFoundError,
        match=r"config.json.*save_pretrained",
    ):
        resolve_model_id(str(tmp_path))


def test_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"no \*.safetensors weights; only safetensors"):
        resolve_model_id(str(tmp_path))


def test_hub_id_offline_fails_clearly(offline):
    with pytest.raises(
        ModelNotFoundError,
        match=r"'google/gemma-4-26B-A4B-it'.*HF_HUB_OFFLINE.*local folder",
    ):
        resolve_model_id("google/gemma-4-26B-A4B-it")
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        load_model("google/gemma-4-26B-A4B-it")


def test_hub_load_failure_becomes_a_clear_error(monkeypatch, tmp_path):
    # Hub "reachable" as far as resolve knows, but the client fails (no network here):
    # the error must say what to do and must not echo the token.
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setattr(modelio, "hub_offline", lambda: False)

    def no_network(*args, **kwargs):
        raise OSError(f"connection refused (Authorization: Bearer {kwargs.get('token')})")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", no_network)
    with pytest.raises(ModelNotFoundError) as error:
        load_model("someone/some-model")
    assert "local folder" in str(error.value)
    assert FAKE_TOKEN not in str(error.value)
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_not_a_model_id():
    with pytest.raises(ModelNotFoundError, match="non-empty string"):
        resolve_model_id("")
    with pytest.raises(ModelNotFoundError, match="just-a-name"):
        resolve_model_id("just-a-name")


def test_hf_token_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert hf_token() is None
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    assert hf_token() == FAKE_TOKEN


def test_load_model_returns_eval_model_and_tokenizer():
    model, tokenizer = load_model(BUNDLED_ID, dtype=torch.bfloat16)
    assert not model.training
    assert model.dtype == torch.bfloat16
    assert type(model).__name__ == "Gemma4ForCausalLM"
    assert tokenizer("The capital of France is").input_ids[0] == tokenizer.bos_token_id
