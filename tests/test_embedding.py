"""The host embedding: the module's own scale, bit for bit, and the self-check that guards it."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from gemma_nb import embedding
from gemma_nb.embedding import (
    EmbeddingCheckError,
    EmbeddingFileError,
    EmbeddingFileNotFoundError,
    EmbeddingScaleError,
    HostEmbedding,
)
from gemma_nb.experiments import embedding_scale
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model


def host_path_model(model, name):
    """``model`` run from the inputs_embeds that host path ``name`` produces."""
    return embedding_scale.HostEmbeddedLM(model, embedding_scale.host_path(model, name))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny_random(request):
    """A random 1-layer Gemma-4 at the bundled checkpoint's width (hidden 128, sqrt = 11.3137)."""
    config = random_gemma4_config(num_hidden_layers=1, vocab_size=512)
    return random_gemma4_model(config, dtype=request.param)


@pytest.fixture(scope="module")
def wide_bf16():
    """The 26B's width (hidden 2816): only the embedding's width matters for the scale."""
    config = random_gemma4_config(
        hidden_size=2816,
        num_hidden_layers=1,
        vocab_size=256,
        num_experts=4,
        top_k_experts=1,
        moe_intermediate_size=16,
        intermediate_size=48,
    )
    return random_gemma4_model(config, dtype=torch.bfloat16)


def test_from_model_is_bit_exact_and_uses_the_module_scale(tiny_random):
    module = tiny_random.get_input_embeddings()
    host = HostEmbedding.from_model(tiny_random)
    assert host.scale.dtype == module.weight.dtype
    assert torch.equal(host.scale, module.embed_scale.to(module.weight.dtype))
    assert host.weight.data_ptr() == module.weight.data_ptr()  # shared, not copied
    ids = torch.arange(512).reshape(4, 128)
    assert torch.equal(host(ids), module(ids))


def test_unscaled_slim_deploy_path_fails_the_self_check(tiny_random, tmp_path):
    """The story's bug: the deploy loads a table with no scale. The check must refuse it."""
    module = tiny_random.get_input_embeddings()
    path = HostEmbedding(module.weight, scale=1.0).save(tmp_path / "embed_tokens.safetensors")
    deployed = HostEmbedding.from_file(path, dtype=module.weight.dtype)
    with pytest.raises(EmbeddingScaleError) as caught:
        deployed.verify_against(module)
    message = str(caught.value)
    expected = module.embed_scale.to(module.weight.dtype).item()
    assert f"expected scale {expected!r}" in message
    assert "found 1.0" in message
    assert "Looks unscaled" in message and "11.3137" in message
    assert isinstance(caught.value, ValueError)


def test_math_sqrt_path_is_exact_in_fp32_and_refused_in_bf16(tiny_random):
    """lookup * math.sqrt(H): the float32 product equals the module's (its fp32 buffer holds the
    same rounded value), so the check passes in fp32. In bf16 torch multiplies at float32
    precision by 11.3137 while the module multiplies by bf16(11.3137) = 11.3125: some products
    land one bf16 ulp apart, so the check must raise."""
    module = tiny_random.get_input_embeddings()
    host = embedding_scale.host_path(tiny_random, "math_sqrt")
    if module.weight.dtype == torch.float32:
        embedding.verify_host_path(host, module)
        return
    with pytest.raises(EmbeddingScaleError, match=r"ulp \(0\.0625\)") as caught:
        embedding.verify_host_path(host, module)
    assert "math.sqrt(128)" in str(caught.value) and "expected scale 11.3125" in str(caught.value)
    diff = embedding_scale.host_path_elementwise(tiny_random, host)
    assert diff["max_diff_ulps"] == 1.0
    assert 0.0 < diff["differ_pct"] < 50.0


def test_math_sqrt_path_at_26b_width(wide_bf16):
    module = wide_bf16.get_input_embeddings()
    assert module.embed_scale.to(torch.bfloat16).item() == 53.0
    with pytest.raises(EmbeddingScaleError, match=r"math\.sqrt\(2816\) = 53\.065997"):
        embedding.verify_host_path(embedding_scale.host_path(wide_bf16, "math_sqrt"), module)
    unscaled = embedding_scale.host_path_elementwise(
        wide_bf16, embedding_scale.host_path(wide_bf16, "unscaled")
    )
    assert unscaled["norm_ratio"] == pytest.approx(53.0, rel=1e-3)
    HostEmbedding.from_model(wide_bf16)  # the fix passes its own check


def test_scale_rounding_of_the_26b_width():
    rounding = embedding_scale.scale_rounding(2816, torch.bfloat16)
    assert rounding["sqrt_exact"] == math.sqrt(2816)
    assert rounding["scale_float32"] == torch.tensor(math.sqrt(2816)).item()
    assert rounding["dtype"] == "bfloat16" and rounding["scale_in_dtype"] == 53.0
    assert rounding["ulp"] == 0.25
    assert rounding["rounding_error_ulps"] == pytest.approx(-0.264, abs=1e-3)


def test_host_path_models_match_the_reference_only_when_exact(tiny_random):
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = tiny_random(input_ids=ids).logits
        fixed = host_path_model(tiny_random, "module_scale")(ids).logits
        unscaled = host_path_model(tiny_random, "unscaled")(ids).logits
    assert torch.equal(fixed, reference)
    assert not torch.allclose(unscaled, reference, atol=1e-2)


def test_host_path_model_with_per_layer_inputs():
    """Configs with per-layer embeddings (not the 26B) get them from the ids, not by inverting."""
    config = random_gemma4_config(
        num_hidden_layers=1, vocab_size=256, hidden_size_per_layer_input=8
    )
    model = random_gemma4_model(config, dtype=torch.float32)
    ids = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        fixed = host_path_model(model, "module_scale")(ids).logits
        host_path_model(model, "unscaled")(ids)  # runs; inverting the table would fail
    assert torch.equal(fixed, reference)


def test_save_and_load_round_trip(tiny_random, tmp_path):
    host = HostEmbedding.from_model(tiny_random)
    path = host.save(tmp_path / "host" / "embed_tokens.safetensors")
    loaded = HostEmbedding.from_file(path, dtype=host.weight.dtype, shape=tuple(host.weight.shape))
    assert torch.equal(loaded.scale, host.scale) and loaded.scale.dtype == host.scale.dtype
    assert torch.equal(loaded.weight, host.weight)
    loaded.verify_against(tiny_random.get_input_embeddings())

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    dtype_name = str(host.weight.dtype).removeprefix("torch.")
    assert metadata["embed_scale"] == repr(host.scale.item())
    assert metadata["embed_scale_dtype"] == dtype_name
    assert metadata["hidden_size"] == "128" and metadata["format"] == embedding.FILE_FORMAT


def test_file_without_metadata_needs_scale(tmp_path):
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    path = tmp_path / "bare.safetensors"
    save_file({"weight": weight}, str(path))
    with pytest.raises(EmbeddingFileError, match=r"'bare\.safetensors'.*'embed_scale'"):
        HostEmbedding.from_file(path)
    # Given as a Python float, it is rounded through float32 like the module's buffer.
    host = HostEmbedding.from_file(path, scale=math.sqrt(128))
    assert host.scale.item() == 11.3125 and host.scale.dtype == torch.bfloat16


def test_conflicting_scale_is_refused(tiny_random, tmp_path):
    path = HostEmbedding.from_model(tiny_random).save(tmp_path / "e.safetensors")
    HostEmbedding.from_file(path, scale=math.sqrt(128))  # same value once rounded: fine
    with pytest.raises(
        EmbeddingScaleError, match=r"stores embed_scale=11\.31.* but scale=1\.0 was given"
    ):
        HostEmbedding.from_file(path, scale=1.0)


def test_missing_file(tmp_path):
    with pytest.raises(
        EmbeddingFileNotFoundError, match=r"'nowhere\.safetensors' not found"
    ) as caught:
        HostEmbedding.from_file(tmp_path / "nowhere.safetensors")
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, FileNotFoundError)
    assert "HostEmbedding.from_model(model).save(path)" in str(caught.value)


def test_wrong_shape_and_dtype_in_file(tmp_path):
    path = HostEmbedding(torch.randn(64, 128), scale=math.sqrt(128)).save(
        tmp_path / "e.safetensors"
    )
    with pytest.raises(
        EmbeddingFileError, match=r"'e\.safetensors'.*shape \(64, 128\), expected \(262144, 2816\)"
    ):
        HostEmbedding.from_file(path, shape=(262144, 2816))
    with pytest.raises(
        EmbeddingFileError, match=r"'e\.safetensors'.*is float32, expected bfloat16"
    ):
        HostEmbedding.from_file(path, dtype=torch.bfloat16)

    flat = tmp_path / "flat.safetensors"
    save_file(
        {"weight": torch.randn(128)},
        str(flat),
        metadata={"embed_scale": "1.0", "embed_scale_dtype": "float32"},
    )
    with pytest.raises(EmbeddingFileError, match=r"'flat\.safetensors'.*shape \(128,\).*2-D"):
        HostEmbedding.from_file(flat)

    renamed = tmp_path / "renamed.safetensors"
    save_file({"embed_tokens.weight": torch.randn(4, 8)}, str(renamed))
    with pytest.raises(
        EmbeddingFileError,
        match=r"\['embed_tokens\.weight'\].*'weight'",
    ):
        HostEmbedding.from_file(renamed)


def test_a_pickled_table_is_not_read(tmp_path):
    path = tmp_path / "embed_tokens.pt"
    torch.save(torch.randn(4, 8), path)
    with pytest.raises(
        EmbeddingFileError,
        match=r"'embed_tokens\.pt'.*weights_only=True",
    ):
        HostEmbedding.from_file(path)


def test_bad_arguments(tiny_random):
    weight = tiny_random.get_input_embeddings().weight
    with pytest.raises(ValueError, match=r"scale=0.*positive"):
        HostEmbedding(weight, scale=0)
    with pytest.raises(EmbeddingCheckError, match=r"embed_scale"):
        HostEmbedding.from_model(torch.nn.Embedding(8, 4))
    other = HostEmbedding(weight[:, :64], scale=1.0)
    with pytest.raises(EmbeddingCheckError, match=r"\(1, 256, 64\)"):
        other.verify_against(tiny_random.get_input_embeddings())


def test_the_file_carries_a_probe_that_catches_a_tampered_scale(tiny_random, tmp_path):
    """from_model stores the model's own output for probe ids; from_file re-checks it, no model
    needed."""
    host = HostEmbedding.from_model(tiny_random)
    path = host.save(tmp_path / "embed_tokens.safetensors")
    loaded = HostEmbedding.from_file(path)
    assert torch.equal(loaded.probe_expected, host.probe_expected)
    assert loaded.probe_ids.shape == (1, 256)

    tampered = HostEmbedding(host.weight, scale=1.0)
    tampered.probe_ids, tampered.probe_expected = host.probe_ids, host.probe_expected
    tampered.save(path)
    with pytest.raises(
        EmbeddingScaleError, match=r"'embed_tokens\.safetensors'.*found 1\.0.*Looks unscaled"
    ):
        HostEmbedding.from_file(path)


def test_host_embedding_for_a_meta_skeleton_checks_the_file_against_it(tmp_path):
    """The slim deploy holds only the structure (meta weights): the file's scale and shape are
    checked against it."""
    from gemma_nb.modelio import model_skeleton

    config = random_gemma4_config(num_hidden_layers=1, vocab_size=256)
    model = random_gemma4_model(config, dtype=torch.float32)
    skeleton = model_skeleton(config)
    assert skeleton.get_input_embeddings().weight.is_meta
    host = embedding.host_embedding_for(
        skeleton, HostEmbedding.from_model(model).save(tmp_path / "e.safetensors")
    )
    ids = torch.arange(256).unsqueeze(0)
    assert torch.equal(host(ids), model.get_input_embeddings()(ids))
    unscaled = HostEmbedding(model.get_input_embeddings().weight, scale=1.0).save(
        tmp_path / "unscaled.safetensors"
    )
    with pytest.raises(EmbeddingScaleError, match=r"stores embed_scale=1\.0 but scale=11\.3137"):
        embedding.host_embedding_for(skeleton, unscaled)
    narrow = HostEmbedding(torch.zeros(128, 128), scale=math.sqrt(128)).save(
        tmp_path / "narrow.safetensors"
    )
    with pytest.raises(EmbeddingFileError, match=r"shape \(128, 128\), expected \(256, 128\)"):
        embedding.host_embedding_for(skeleton, narrow)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def bundled(request):
    from gemma_nb.modelio import load_model

    return load_model(dtype=request.param)


def test_fixed_path_decodes_like_the_reference_on_the_bundled_checkpoint(bundled):
    """The deploy's host path (module scale) gives the reference's greedy tokens, token for
    token."""
    from gemma_nb import evaluate
    from gemma_nb.tiny import FACTS

    model, tokenizer = bundled
    fixed = host_path_model(model, "module_scale")
    prompt = tokenizer("The capital of France is").input_ids
    result = evaluate.greedy_match(model, fixed, prompt, steps=8, tokenizer=tokenizer)
    assert result["match"], result
    assert result["reference_text"].startswith("Paris .")

    prompts = [tokenizer(f.prompt).input_ids for f in FACTS[::16]]
    length = max(set(map(len, prompts)), key=[len(p) for p in prompts].count)
    batch = torch.tensor([p for p in prompts if len(p) == length])
    assert torch.equal(
        evaluate.greedy_generate(fixed, batch, 6), evaluate.greedy_generate(model, batch, 6)
    )

    unscaled = host_path_model(model, "unscaled")
    broken = evaluate.greedy_match(model, unscaled, prompt, steps=8, tokenizer=tokenizer)
    assert not broken["match"] and not broken["candidate_text"].startswith("Paris")


def test_self_check_on_the_bundled_checkpoint(bundled, tmp_path):
    """Unscaled is refused in both dtypes; math.sqrt only in bf16 (exact in fp32); the file path
    passes."""
    model, _ = bundled
    module = model.get_input_embeddings()
    with pytest.raises(EmbeddingScaleError, match="Looks unscaled"):
        embedding.verify_host_path(embedding_scale.host_path(model, "unscaled"), module)
    if module.weight.dtype == torch.bfloat16:
        with pytest.raises(EmbeddingScaleError, match="applied differently"):
            embedding.verify_host_path(embedding_scale.host_path(model, "math_sqrt"), module)
    else:
        embedding.verify_host_path(embedding_scale.host_path(model, "math_sqrt"), module)
    path = HostEmbedding.from_model(model).save(tmp_path / "embed_tokens.safetensors")
    deployed = HostEmbedding.from_file(
        path, dtype=module.weight.dtype, shape=tuple(module.weight.shape)
    )
    ids = torch.arange(module.weight.shape[0]).unsqueeze(0)
    assert torch.equal(deployed(ids), module(ids))  # the whole vocabulary, not only the probe


def test_the_module_forward_notebook_06_quotes_is_the_installed_one():
    """Notebook 06 quotes Gemma4TextScaledWordEmbedding.forward in its prose instead of printing its
    source."""
    import inspect
    import json

    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    from gemma_nb.paths import NOTEBOOKS_DIR

    quoted = "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)"
    assert quoted in inspect.getsource(Gemma4TextScaledWordEmbedding.forward)
    notebook = json.loads((NOTEBOOKS_DIR / "06_embedding_scale.ipynb").read_text())
    assert any(
        quoted in "".join(cell["source"])
        for cell in notebook["cells"]
        if cell["cell_type"] == "markdown"
    )
