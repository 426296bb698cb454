"""gemma_nb.export: torch.export of the two steps: token-for-token equality with eager decoding, and
bad artifacts."""

import json
import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb import artifact, export  # noqa: E402
from gemma_nb.artifact import ArtifactError, ArtifactNotFoundError, load_program  # noqa: E402
from gemma_nb.embedding import HostEmbedding  # noqa: E402
from gemma_nb.evaluate import greedy_generate  # noqa: E402
from gemma_nb.tiny import random_gemma4_config, random_gemma4_model  # noqa: E402

SHAPES = export.StepShapes(max_cache_len=48, prefill_len=16)
PROMPT = torch.tensor([[5, 17, 99, 3, 250, 7]])
# A sliding and a full attention layer: two halve the export and the load of the artifact the tests
# share. The bundled checkpoint's four are exported, and its greedy tokens compared with eager's, by
# notebook 04, whose table nbval compares (`make test`).
LAYERS = 2


@pytest.fixture(scope="module")
def tiny():
    config = random_gemma4_config(num_hidden_layers=LAYERS)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    return random_gemma4_model(config, seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("artifact")
    report = export.compile_model(tiny, folder, SHAPES)
    return folder, report


@pytest.fixture(scope="module")
def runner(built):
    folder, _ = built
    return export.load_artifact(folder).runner(
        HostEmbedding.from_file(export.host_embedding_path(folder))
    )


@pytest.fixture
def copy(built, tmp_path):
    folder = tmp_path / "artifact"
    shutil.copytree(built[0], folder)
    return folder


def test_thirty_tokens_match_eager_greedy_and_program_holds_no_weights(
    tiny, built, runner, eager_runner
):
    folder, report = built
    expected = greedy_generate(tiny, PROMPT, 30)
    assert torch.equal(runner.generate(PROMPT, 30), expected)
    # The un-exported body with the same loop agrees too (so the loop, not export, is tested).
    assert torch.equal(eager_runner(tiny, SHAPES).generate(PROMPT, 30), expected)
    program, meta = load_program(folder / "decode.pt2")
    assert len(program.state_dict) == 0
    # Constants are only rotary frequencies: far below the weights.
    constant_bytes = sum(t.numel() * t.element_size() for t in program.constants.values())
    assert constant_bytes < 10_000
    weight_names = set(meta["weights"])
    assert "lm_head.weight" in weight_names and artifact.HOST_EMBEDDING_KEY not in weight_names
    assert weight_names == set(export.device_weights(tiny))
    assert report.weights_bytes > 10 * sum(report.program_bytes.values()) / 2


def test_off_by_one_position_diverges(tiny, runner):
    """Feeding each generated token one position too far (transformers' executorch generate)
    drifts."""
    from dataclasses import replace

    decode = runner.decode
    shifted = replace(
        runner, decode=lambda w, kv, embeds, start, last: decode(w, kv, embeds, start + 1, last)
    )
    wrong = shifted.generate(PROMPT, 16)[0, PROMPT.shape[1] :]
    expected = runner.generate(PROMPT, 16)[0, PROMPT.shape[1] :]
    assert wrong[0] == expected[0]  # the prefill token is right
    assert (wrong != expected).sum() > 5


def test_limits_of_the_static_shapes(runner):
    with pytest.raises(ValueError, match="bucket of 16"):
        runner.generate(torch.arange(3, 20)[None], 4)
    with pytest.raises(ValueError, match="max_cache_len=48"):
        runner.generate(PROMPT, 60)


def test_eager_experts_are_switched_to_a_traceable_implementation():
    model = random_gemma4_model(random_gemma4_config(num_hidden_layers=1), dtype=torch.float32)
    model.set_experts_implementation("eager")
    assert export.set_traceable_experts(model) == "grouped_mm"
    assert model.config._experts_implementation == "grouped_mm"


# ---- bad artifacts: each names the file and what was expected --------------------------------
def test_manifest_names_transformers_experts_by_their_implementation(built, tiny):
    folder, _ = built
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (
        manifest["experts_implementation"]
        == export.experts_implementation(tiny)
        == tiny.config._experts_implementation
    )


@pytest.mark.parametrize("name", ["tp0_weights.safetensors", "decode.pt2", "manifest.json"])
def test_missing_file(copy, name):
    (copy / name).unlink()
    with pytest.raises(ArtifactNotFoundError, match=f"{name} not found.*expected"):
        export.check_artifact(copy)


def test_missing_folder(tmp_path):
    with pytest.raises(ArtifactError, match="nowhere/"):
        export.load_artifact(tmp_path / "nowhere")


def test_load_artifact_runs_the_same_checks(copy):
    (copy / "tp0_weights.safetensors").write_bytes(b"12345")
    with pytest.raises(ArtifactError, match="tp0_weights.safetensors is 5 bytes: too short"):
        export.load_artifact(copy)


def test_truncated_weights(copy):
    path = copy / "tp0_weights.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ArtifactError,
        match="tp0_weights.safetensors is truncated",
    ):
        export.check_artifact(copy)
    path.write_bytes(data[:5])
    with pytest.raises(ArtifactError, match="too short"):
        export.check_artifact(copy)


def test_truncated_program(copy):
    path = copy / "prefill.pt2"
    path.write_bytes(path.read_bytes()[:4000])
    with pytest.raises(ArtifactError, match="prefill.pt2.*torch.export"):
        export.check_artifact(copy)


def test_wrong_tensor_shape(tiny, copy, built):
    weights = dict(export.device_weights(tiny))
    weights["model.norm.weight"] = torch.ones(7)
    artifact.save_weights(weights, copy / "tp0_weights.safetensors", built[1].config_sha)
    with pytest.raises(
        ArtifactError, match=r"'model.norm.weight' is float32 \(7,\), .* expects float32 \(128,\)"
    ):
        export.check_artifact(copy)


def test_wrong_tensor_names(tiny, copy, built):
    weights = dict(export.device_weights(tiny))
    weights["model.layers.0.router.gate.weight"] = weights.pop("model.layers.0.router.proj.weight")
    artifact.save_weights(weights, copy / "tp0_weights.safetensors", built[1].config_sha)
    with pytest.raises(
        ArtifactError,
        match=r"missing 1 tensor\(s\) \['model.layers.0.router.proj.weight'\]; "
        r"unexpected 1 tensor\(s\) \['model.layers.0.router.gate.weight'\]",
    ):
        export.check_artifact(copy)


def test_weights_from_another_config(copy):
    # Same shapes, different model (sliding window): only the config fingerprint tells them apart.
    other = random_gemma4_model(
        random_gemma4_config(num_hidden_layers=LAYERS, sliding_window=32),
        seed=1,
        dtype=torch.float32,
    )
    artifact.save_weights(
        export.device_weights(other),
        copy / "tp0_weights.safetensors",
        artifact.config_fingerprint(other.config),
    )
    with pytest.raises(ArtifactError, match="tp0_weights.safetensors.*config"):
        export.check_artifact(copy)


def test_program_from_another_config(copy):
    import zipfile

    # Rewrite the program's stored metadata as if it had been compiled for another config.
    path = copy / "decode.pt2"
    with zipfile.ZipFile(path) as source:
        members = {info.filename: source.read(info) for info in source.infolist()}
    with zipfile.ZipFile(path, "w") as target:
        for name, data in members.items():
            if name.endswith(artifact.PROGRAM_EXTRA):
                meta = json.loads(data)
                meta["config_sha"] = "0123456789abcdef"
                data = json.dumps(meta).encode()
            target.writestr(name, data)
    with pytest.raises(ArtifactError, match="decode.pt2.*0123456789abcdef"):
        export.check_artifact(copy)


def test_corrupt_manifest(copy):
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="manifest.json.*JSON"):
        export.check_artifact(copy)
