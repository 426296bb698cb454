"""The neuron artifact contract, on the cpu: compile writes one folder, a "different box" deploys
and serves from that folder alone.

The traced NxD model is replaced by a stand-in: the cpu variant of the same traced module
(``NeuronGemma4(parallel=False)``), its state saved as ``model.pt`` and stepped through
``CpuStateGraph`` (aliased KV state written back, as the Neuron runtime does). Everything else is
the code an inf2 runs: ``finish_artifact`` (config, tokenizer, host embedding with its self-check
data, manifest), ``read_artifact``, ``slim_deploy``, ``serve``'s neuron runtime.
"""

import ast
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from artifact_answer import greedy_answer
from cpu_state_graph import CpuStateGraph

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb.neuron import build_folder as A  # noqa: E402
from gemma_nb.neuron import deploy as ND  # noqa: E402
from gemma_nb.neuron.build import NeuronBuildConfig, NeuronGemma4, read_hf_state, text_config  # noqa: E402
from gemma_nb.tiny import CHECKPOINT_DIR  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN, BUCKET = 64, 16
PROMPT = "The capital of France is"


def stand_in_compile(model_dir: Path, out_dir: Path) -> dict:
    """What compile_neuron does, with the cpu module's state as the "traced model"."""
    config = text_config(model_dir)
    build = NeuronBuildConfig(
        model_dir=str(model_dir),
        output_dir=str(out_dir),
        tp_degree=1,
        max_len=MAX_LEN,
        bucket=BUCKET,
        dtype="float32",
    )
    module = NeuronGemma4(config, build, parallel=False)
    state = read_hf_state(model_dir)
    # tied; the graph holds its own head
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    module.load_state(state)
    out_dir.mkdir(parents=True)
    torch.save(module.state_dict(), out_dir / A.MODEL_FILE)
    record = {
        "build": asdict(build),
        "versions": {"torch": torch.__version__},
        "sdk": "Neuron SDK",
        "graphs": build.graph_keys(),
        "routed_graphs": build.routed_graphs(),
    }
    return A.finish_artifact(model_dir, out_dir, record)


def stand_in_load(folder: Path):
    """The cpu counterpart of ``load_artifact``: reads only ``folder``."""
    artifact = A.read_artifact(folder)
    build = NeuronBuildConfig(**artifact.record["build"])
    module = NeuronGemma4(artifact.config, build, parallel=False)
    module.load_state_dict(torch.load(folder / A.MODEL_FILE, weights_only=True))
    return CpuStateGraph(module)


@pytest.fixture(scope="module")
def moved_artifact(tmp_path_factory):
    """Compile on "box 1", copy the artifact folder to "box 2", delete box 1 (checkpoint
    included)."""
    box1, box2 = tmp_path_factory.mktemp("compile_box"), tmp_path_factory.mktemp("serving_box")
    shutil.copytree(CHECKPOINT_DIR, box1 / "checkpoint")
    manifest = stand_in_compile(box1 / "checkpoint", box1 / "artifact")
    shutil.copytree(box1 / "artifact", box2 / "artifact")
    shutil.rmtree(box1)
    return box2 / "artifact", manifest


@pytest.fixture(scope="module")
def reference_ids():
    from gemma_nb.evaluate import greedy_generate
    from gemma_nb.modelio import load_model
    from gemma_nb.tiny import BUNDLED_ID

    model, tokenizer = load_model(BUNDLED_ID)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        return ids, greedy_generate(model, ids, 6), tokenizer


def test_compile_writes_every_file_the_serving_box_needs(moved_artifact):
    folder, manifest = moved_artifact
    assert manifest["format"] == A.FORMAT and manifest["format_version"] == A.FORMAT_VERSION
    assert manifest["graphs"] == ["prefill", "decode_dense"]
    assert (manifest["max_len"], manifest["bucket"], manifest["tp_degree"]) == (MAX_LEN, BUCKET, 1)
    for name in (*A.REQUIRED_FILES, "tokenizer.json", "generation_config.json"):
        assert manifest["files"][name] == (folder / name).stat().st_size > 0
    from gemma_nb.embedding import HostEmbedding

    # its scale self-check runs at load
    host = HostEmbedding.from_file(folder / A.HOST_EMBEDDING_FILE)
    assert float(host.scale) == pytest.approx(128**0.5)


def test_deploy_on_a_different_box_decodes_like_transformers(
    moved_artifact, reference_ids, monkeypatch
):
    folder, _ = moved_artifact
    ids, expected, _ = reference_ids
    monkeypatch.setattr(ND, "load_artifact", stand_in_load)
    runner, figures = ND.slim_deploy(folder)
    assert figures["decode_graph"] == "decode_dense"
    assert (runner.max_len, runner.bucket) == (MAX_LEN, BUCKET)
    assert torch.equal(runner.generate(ids, 6), expected)
    assert greedy_answer(runner, folder, max_new_tokens=8) == "Paris ."


def test_artifacts_are_named_by_their_decode_graphs(moved_artifact):
    folder, manifest = moved_artifact
    assert manifest["decode_graph"] == "decode_dense"  # the port's DenseExperts decode graph
    assert A.artifact_labels([folder, "", folder]) == {"dense": folder, "dense_2": folder}


def test_server_answers_from_the_artifact_alone(serve_in_thread, moved_artifact, monkeypatch):
    import openai

    from gemma_nb.endpoint import wait_until_healthy
    from gemma_nb.serving import backends
    from gemma_nb.serving.app import create_app

    folder, _ = moved_artifact
    monkeypatch.setattr(ND, "load_artifact", stand_in_load)
    monkeypatch.setattr(backends, "check_target", lambda target: target)  # the SDK is stood in for
    runtime = backends.load_runtime("neuron", artifact=str(folder))
    app = create_app(runtime, model_name="tiny-on-inf2", queue_size=2)
    with serve_in_thread(app) as root:
        wait_until_healthy(root + "/v1", timeout_s=60)
        client = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="tiny-on-inf2",
            temperature=0,
            max_tokens=8,
            messages=[{"role": "user", "content": PROMPT}],
        )
    assert reply.choices[0].message.content == "Paris ."


def test_a_truncated_copy_is_refused_with_the_fix(moved_artifact, tmp_path):
    folder, _ = moved_artifact
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    with open(copy / A.HOST_EMBEDDING_FILE, "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(A.ArtifactError, match=r"embed_tokens.safetensors is 100 bytes.*copy"):
        A.read_artifact(copy)
    (copy / A.MANIFEST).unlink()
    with pytest.raises(A.ArtifactError, match="no manifest.json"):
        A.read_artifact(copy)
    with pytest.raises(A.ArtifactError, match="nowhere"):
        A.read_artifact(tmp_path / "nowhere")


def test_a_manifest_of_another_version_is_refused(moved_artifact, tmp_path):
    folder, _ = moved_artifact
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / A.MANIFEST).read_text())
    manifest["format_version"] = A.FORMAT_VERSION + 1
    (copy / A.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(A.ArtifactError, match=f"version {A.FORMAT_VERSION + 1}.*compile again"):
        A.read_artifact(copy)


def test_a_checkpoint_without_tokenizer_is_refused(tmp_path):
    model_dir = tmp_path / "weights_only"
    model_dir.mkdir()
    shutil.copyfile(CHECKPOINT_DIR / "config.json", model_dir / "config.json")
    with pytest.raises(A.ArtifactError, match="tokenizer"):
        A.write_serving_files(model_dir, tmp_path / "artifact")


class FakeModelBuilder:
    """ModelBuilder's calls as compile_neuron makes them; ``trace`` returns a scripted empty module
    (no NEFF here), ``shard_checkpoint`` runs the real checkpoint conversion."""

    def __init__(self, router, tp_degree, checkpoint_loader, compiler_workdir):
        self.loader, self.keys, self.instances = checkpoint_loader, [], []

    def add(self, key, instance, example_inputs, compiler_args):
        self.keys.append(key)
        self.instances.append(instance)

    def shard_checkpoint(self):
        self.instances[0].module = torch.nn.Module()  # sharded against: no parameter to miss
        return [self.loader()]  # the converted int8 checkpoint of the model folder

    def trace(self, initialize_model_weights):
        return torch.jit.script(torch.nn.Identity())


def test_compile_neuron_writes_the_whole_folder(tmp_path, monkeypatch):
    """The real compile_neuron with the SDK faked: the build record and the serving files land in
    the artifact folder, and the manifest names the decode graph a decode step reaches."""
    from types import SimpleNamespace

    from gemma_nb.neuron import build as B
    from gemma_nb.tiny import TP2_CHECKPOINT_DIR

    class FakeInstance:
        def __init__(self, module_cls, input_output_aliases):
            pass

    fake = SimpleNamespace(ModelBuilder=FakeModelBuilder, BaseModelInstance=FakeInstance)
    monkeypatch.setattr(B, "import_sdk", lambda: fake)
    out = tmp_path / "artifact"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"x")  # an older build's file: the folder is written afresh
    build = NeuronBuildConfig(
        model_dir=str(TP2_CHECKPOINT_DIR), output_dir=str(out), decode_experts="sparse"
    )
    record = B.compile_neuron(build, sample_interval_s=0.05)
    assert not (out / "stale.bin").exists()
    assert record["sdk"] == "Neuron SDK" and record["build"]["compiler_args"] == B.COMPILER_ARGS
    # converted once, int8, where rsync leaves it behind
    assert (out / "compiler_workdir" / B.CONVERTED_FILE).is_file()
    artifact = A.read_artifact(out)
    assert artifact.graphs == ["prefill", "decode_sparse"]
    assert artifact.decode_graph == "decode_sparse"
    assert A.artifact_labels([out]) == {"sparse": out}
    assert artifact.config.num_attention_heads == 16 and (artifact.max_len, artifact.bucket) == (
        512,
        128,
    )
    for name in (*A.REQUIRED_FILES, "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file()


def test_each_build_is_deployed_and_compiled_in_a_process_of_its_own(
    moved_artifact, reference_ids, monkeypatch
):
    from gemma_nb.neuron import runs
    from gemma_nb.peak_rss import MeasuredRun

    folder, _ = moved_artifact
    ids, expected, _ = reference_ids
    monkeypatch.setattr(ND, "load_artifact", stand_in_load)
    processes = []

    def in_own_process(module, *args):  # the child's work, here, with what the parent measures
        processes.append((module, args))
        if module == "gemma_nb.neuron.build":
            return MeasuredRun({"build": json.loads(args[0])}, 1, 1, 0.1, [])
        result = runs.deploy_and_decode(args[0], json.loads(args[1]), *map(int, args[2:]))
        return MeasuredRun(json.loads(json.dumps(result)), 123, 456, 0.1, [])

    monkeypatch.setattr(runs, "in_own_process", in_own_process)
    table = runs.deploy_each([folder, folder], PROMPT, new_tokens=3, repeats=1)
    assert [module for module, _ in processes] == ["gemma_nb.neuron.runs"] * 2
    assert (
        list(table.index) == ["dense", "dense_2"]
        and list(table["peak_host_rss_bytes"]) == [123] * 2
    )
    assert table.loc["dense_2", "tokens"] == expected[0, : ids.shape[1] + 3].tolist()
    assert table["completion"].tolist() == ["Paris .", "Paris ."]  # cut at the first <eos>
    answers = runs.answer_each([folder], PROMPT, max_new_tokens=8)
    assert answers[0]["completion"] == "Paris ." and answers[0]["build"] == folder.name
    processes.clear()
    records = runs.compile_builds(folder, "neuron", ["dense", "sparse"])
    assert [module for module, _ in processes] == ["gemma_nb.neuron.build"] * 2
    assert [r["build"]["decode_experts"] for r in records.values()] == ["dense", "sparse"]


# --------------------------------------------------------------------------------------------
# Every symbol the notebooks' neuron cells import exists
# --------------------------------------------------------------------------------------------
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _neuron_cell_imports():
    found = []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or "neuron" not in source:
                continue
            tree = ast.parse(
                "\n".join(line for line in source.splitlines() if not line.startswith(("%", "!")))
            )
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.module
                    and node.module.startswith("gemma_nb")
                ):
                    found += [(path.stem, node.module, alias.name) for alias in node.names]
                elif isinstance(node, ast.Import):
                    found += [
                        (path.stem, alias.name, None)
                        for alias in node.names
                        if alias.name.startswith("gemma_nb")
                    ]
    return found


def test_notebook_neuron_cells_import_only_what_exists():
    import importlib

    imports = _neuron_cell_imports()
    assert any(module.startswith("gemma_nb.neuron") for _, module, _ in imports)
    for notebook, module, name in imports:
        imported = importlib.import_module(module)
        if name is not None:
            is_submodule = (
                hasattr(imported, "__path__")
                and importlib.util.find_spec(f"{module}.{name}") is not None
            )
            assert hasattr(imported, name) or is_submodule, (
                f"{notebook}: from {module} import {name}: no such name"
            )


def test_notebook_neuron_cells_call_only_what_exists():
    """Attribute calls on imported gemma_nb modules (e.g. ``neuron_quant.run_trials``) exist too."""
    import importlib

    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or "gemma_nb.neuron" not in source:
                continue
            tree = ast.parse(source)
            aliases = {}
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.module
                    and node.module.startswith("gemma_nb")
                ):
                    for alias in node.names:
                        target = importlib.import_module(node.module)
                        value = getattr(target, alias.name, None)
                        if (
                            value is not None
                            and hasattr(value, "__name__")
                            and isinstance(value, type(os))
                        ):
                            aliases[alias.asname or alias.name] = value
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in aliases
                ):
                    assert hasattr(aliases[node.value.id], node.attr), (
                        f"{path.stem}: {node.value.id}.{node.attr} does not exist"
                    )
