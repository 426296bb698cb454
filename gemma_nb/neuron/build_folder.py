"""The artifact folder the compile writes (notebook 04) and the serving box reads (05, 07, the
server): the graphs, build record, host embedding, config and tokenizer, and a manifest of every
file's size (a truncated copy fails at load)."""

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import torch

# the names both artifact folders use
from gemma_nb.artifact import (
    HOST_EMBEDDING_FILE,
    MANIFEST,
    ArtifactError,
)
from gemma_nb.embedding import HostEmbedding
from gemma_nb.modelio import model_skeleton
from gemma_nb.neuron.checkpoint import read_hf_state, text_config
from gemma_nb.paths import artifacts_dir

FORMAT = "gemma-nb-neuron-artifact"
FORMAT_VERSION = 1
MODEL_FILE = "model.pt"
BUILD_RECORD = "build_record.json"
CONFIG_FILE = "config.json"
# Copied when the model folder has them; a tokenizer needs tokenizer_config.json and one of the
# first two.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
REQUIRED_FILES = (
    MODEL_FILE,
    BUILD_RECORD,
    HOST_EMBEDDING_FILE,
    CONFIG_FILE,
    "tokenizer_config.json",
)
DECODE_PATHS = ("dense", "sparse")  # the port's decode, then the fix: one artifact each


def write_serving_files(model_dir: str | Path, artifact_dir: str | Path) -> None:
    """Copy config and tokenizer files from the checkpoint folder and write the host embedding."""
    model_dir, artifact_dir = Path(model_dir), Path(artifact_dir)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    written = [name for name in (CONFIG_FILE, *TOKENIZER_FILES) if (model_dir / name).is_file()]
    for name in written:
        shutil.copyfile(model_dir / name, artifact_dir / name)
    if "tokenizer_config.json" not in written or not {"tokenizer.json", "tokenizer.model"} & set(
        written
    ):
        raise ArtifactError(
            f"{model_dir.name}/ has no complete tokenizer (tokenizer_config.json and "
            "tokenizer.json or tokenizer.model): download the whole model folder, not only the "
            "weights"
        )
    # the text model's table only
    state = read_hf_state(model_dir, only=lambda name: name == "model.embed_tokens.weight")
    scale = model_skeleton(text_config(model_dir)).get_input_embeddings().scalar_embed_scale
    HostEmbedding(state["model.embed_tokens.weight"], torch.tensor(scale)).save(
        artifact_dir / HOST_EMBEDDING_FILE
    )


def finish_artifact(model_dir: str | Path, artifact_dir: str | Path, record: dict) -> dict:
    """After the model: the build ``record``, the serving files, then ``manifest.json`` (graphs,
    shapes, file sizes)."""
    artifact_dir = Path(artifact_dir)
    (artifact_dir / BUILD_RECORD).write_text(json.dumps(record, indent=2))
    write_serving_files(model_dir, artifact_dir)
    build = record["build"]
    files = {
        p.name: p.stat().st_size
        for p in sorted(artifact_dir.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "graphs": list(record["graphs"]),
        "decode_graph": record["routed_graphs"]["decode"],
        "tp_degree": build["tp_degree"],
        "max_len": build["max_len"],
        "bucket": build["bucket"],
        "sdk": record["sdk"],
        "versions": record["versions"],
        "files": files,
    }
    (artifact_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


class NeuronArtifact(NamedTuple):
    """A validated artifact folder; ``decode_graph`` is the one ModelBuilder routes a decode step (S
    = 1) to."""

    folder: Path
    manifest: dict
    record: dict
    config: object
    max_len: int
    bucket: int
    graphs: list[str]
    decode_graph: str


def default_artifact_dir(target: str = "neuron", decode_experts: str = "dense") -> Path:
    """Where notebook 04 writes the artifact of a decode path (``04_neuron_dense``,
    ``04_neuron_sparse``)."""
    return artifacts_dir(target) / f"04_neuron_{decode_experts}"


def built_artifacts(target: str = "neuron") -> list[Path]:
    """The artifact folders notebook 04 wrote for ``target``, dense first; ``ArtifactError`` when
    none."""
    folders = [
        default_artifact_dir(target, d)
        for d in DECODE_PATHS
        if default_artifact_dir(target, d).is_dir()
    ]
    if not folders:
        raise ArtifactError(
            f"no artifact under {artifacts_dir(target).name}/: run notebook 04 on the neuron "
            "target first (python -m gemma_nb run --target neuron --only 04), or pass -p "
            "neuron_artifacts"
        )
    return folders


def artifact_labels(folders) -> dict[str, Path]:
    """Each folder named by its decode graph (``dense``, ``sparse``), empty ones skipped."""
    labels = {}
    for folder in (f for f in folders if f):
        name = read_artifact(folder).decode_graph.removeprefix("decode_")
        labels[name if name not in labels else f"{name}_{len(labels) + 1}"] = Path(folder)
    return labels


def read_artifact(folder: str | Path) -> NeuronArtifact:
    """Validate ``folder`` against its manifest (format, version, every file and size) and load its
    config."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactError(
            f"artifact folder {folder.name!r} does not exist: pass the folder compile_neuron "
            "wrote (notebook 04's outputs/neuron/artifacts/04_neuron_dense or _sparse), copied "
            "whole to this box"
        )
    if not (folder / MANIFEST).is_file():
        raise ArtifactError(
            f"{folder.name}/ has no {MANIFEST}: not a finished gemma-nb neuron artifact; compile "
            "it with gemma_nb.neuron.build.compile_neuron"
        )
    manifest = json.loads((folder / MANIFEST).read_text())
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{folder.name}/{MANIFEST} is format {manifest.get('format')!r} version "
            f"{manifest.get('format_version')!r}; this gemma_nb reads {FORMAT!r} version "
            f"{FORMAT_VERSION}: compile again with this version"
        )
    for name, size in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise ArtifactError(
                f"{folder.name}/{name} is missing (listed in {MANIFEST}): copy the whole folder "
                "again"
            )
        if path.stat().st_size != size:
            raise ArtifactError(
                f"{folder.name}/{name} is {path.stat().st_size} bytes, {MANIFEST} says {size}: "
                "an incomplete copy; copy the folder again (e.g. rsync -a --partial)"
            )
    missing = [name for name in REQUIRED_FILES if name not in manifest["files"]]
    if missing:
        raise ArtifactError(
            f"{folder.name}/{MANIFEST} lists no {', '.join(missing)}: compile again"
        )
    record = json.loads((folder / BUILD_RECORD).read_text())
    return NeuronArtifact(
        folder,
        manifest,
        record,
        text_config(folder),
        int(manifest["max_len"]),
        int(manifest["bucket"]),
        list(manifest["graphs"]),
        manifest["decode_graph"],
    )
