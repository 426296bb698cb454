"""The emulated Neuron SDK (gemma_nb.rehearsal) refuses what the SDK refuses, and gemma_nb.neuron
passes it.

The emulation is importable only with ``gemma_nb/rehearsal/sdk_path`` on ``sys.path`` (``make
rehearse``); the ``emulated_sdk`` fixture puts it there for a test and takes it away afterwards.
"""

import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from artifact_answer import greedy_answer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gemma_nb.neuron import build as B  # noqa: E402
from gemma_nb.neuron import deploy as ND  # noqa: E402
from gemma_nb.neuron import sdk  # noqa: E402
from gemma_nb.neuron.runs import SMOKE_SHAPES  # noqa: E402
from gemma_nb.rehearsal import host, nxd_model, spmd  # noqa: E402
from gemma_nb.rehearsal.rehearse import SDK_PATH, box_environments  # noqa: E402
from gemma_nb.tiny import TP2_CHECKPOINT_DIR  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN, BUCKET = SMOKE_SHAPES["max_len"], SMOKE_SHAPES["bucket"]  # the smoke run's shapes
EMULATED_MODULES = ("neuronx_distributed", "torch_neuronx", sdk.FX_MODULE)


def _forget_emulated_modules():
    for name in list(sys.modules):
        if name.split(".")[0] in ("neuronx_distributed", "torch_neuronx") or name == sdk.FX_MODULE:
            del sys.modules[name]


@pytest.fixture(scope="module")
def emulated_sdk():
    """The emulated SDK importable for this module's tests, with fresh emulated NeuronCores."""
    assert importlib.util.find_spec("neuronx_distributed") is None  # never importable by accident
    sys.path.insert(0, str(SDK_PATH))
    importlib.invalidate_caches()
    try:
        yield sdk.import_sdk(note=lambda text: None)
    finally:
        sys.path.remove(str(SDK_PATH))
        _forget_emulated_modules()
        torch.jit.load = nxd_model._JIT_LOAD
        if "neuron" in vars(torch.classes):
            delattr(torch.classes, "neuron")
        spmd._CORES = None


@pytest.fixture()
def cores(emulated_sdk):
    """Fresh emulated cores of 16 GiB each, as a fresh process has."""
    spmd._CORES = spmd.Cores()
    yield spmd._CORES
    spmd._CORES = None


@pytest.fixture(scope="module")
def builds(emulated_sdk, tmp_path_factory):
    """Both builds of the bundled TP=2 checkpoint compiled with the emulated SDK, each on the fresh
    NeuronCores of a process of its own."""
    root = tmp_path_factory.mktemp("compile_box")
    records = {}
    for decode in ("dense", "sparse"):
        spmd._CORES = spmd.Cores()
        build = B.NeuronBuildConfig(
            model_dir=str(TP2_CHECKPOINT_DIR),
            output_dir=str(root / decode),
            max_len=MAX_LEN,
            bucket=BUCKET,
            decode_experts=decode,
        )
        records[decode] = B.compile_neuron(build, sample_interval_s=0.05)
    spmd._CORES = None
    return root, records


def test_the_emulation_says_so_everywhere(emulated_sdk, builds):
    status = sdk.check_sdk()
    assert status.ok and status.emulated
    # the first import met NxD 0.18's transformers.utils.fx import, emulated
    assert emulated_sdk.fx_workaround
    assert status.message().startswith("emulated SDK (gemma_nb.rehearsal")
    assert emulated_sdk.emulated and sys.modules["neuronx_distributed"].__emulated__
    root, records = builds
    for decode, record in records.items():
        assert record["sdk"] == B.sdk_label(emulated_sdk) and record["sdk"].startswith(
            "emulated SDK"
        )
        manifest = (root / decode / "manifest.json").read_text()
        assert '"sdk": "emulated SDK (gemma_nb.rehearsal, not the Neuron SDK)"' in manifest


def test_each_build_decodes_the_fact_after_a_copy_to_another_box(builds, cores, tmp_path):
    root, records = builds
    for decode in ("dense", "sparse"):
        copy = tmp_path / decode
        shutil.copytree(root / decode, copy, ignore=shutil.ignore_patterns("compiler_workdir"))
        runner, figures = ND.slim_deploy(copy)
        assert greedy_answer(runner, copy, max_new_tokens=6) == "Paris ."
        assert figures["decode_graph"] == f"decode_{decode}"
        assert runner.graph.model.nxd_model.calls == {"prefill": 1, f"decode_{decode}": 2}
        assert figures["sdk"].startswith("emulated SDK")
        spmd._CORES = spmd.Cores()  # the next deploy's own process


def test_a_second_model_does_not_fit_in_one_process(builds, cores, emulated_sdk):
    root, _ = builds
    graph = ND.load_artifact(root / "dense")
    held = cores.used(0)
    cores.hbm_bytes = int(1.5 * held)  # the 26B's case: one build fits a core, two do not
    with pytest.raises(spmd.AllocationError, match=r"NeuronCore 0: status=4 Allocation Failure"):
        ND.load_artifact(root / "sparse")
    del graph  # dropping the references gives nothing back: only the process's exit does
    with pytest.raises(spmd.AllocationError, match="load each model in its own process"):
        ND.load_artifact(root / "sparse")


def test_the_rehearsal_s_hbm_budget_holds_one_smoke_build_and_not_two(builds, emulated_sdk):
    """As one 26B build fills most of a real NeuronCore, one smoke build fills most of an emulated
    one."""
    from gemma_nb import memory
    from gemma_nb.tools import plan as planner

    root, _ = builds
    box = box_environments()["serving"]
    hbm = int(box["GEMMA_NB_EMULATED_HBM_BYTES"])
    runtime = int(box["GEMMA_NB_EMULATED_RUNTIME_BYTES"])
    spmd._CORES = spmd.Cores(hbm_bytes=hbm, runtime_bytes=runtime)
    try:
        ND.load_artifact(root / "dense")
        assert spmd.cores().used(0) <= hbm  # preflight's plan fits it too:
        assert (
            memory.plan(B.text_config(TP2_CHECKPOINT_DIR), 2, planner.DEFAULT_SCHEME).total_bytes
            <= hbm
        )
        with pytest.raises(spmd.AllocationError, match="status=4 Allocation Failure"):
            ND.load_artifact(root / "sparse")
    finally:
        spmd._CORES = None


def test_the_emulation_is_not_importable_outside_the_rehearsal():
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", "import neuronx_distributed"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 1 and "named 'neuronx_distributed'" in done.stderr


def test_the_runtime_routes_by_shape_and_refuses_other_dtypes_and_shapes(builds, cores):
    root, _ = builds
    graph = ND.load_artifact(root / "sparse")
    config = B.text_config(TP2_CHECKPOINT_DIR)
    build = B.NeuronBuildConfig("m", "o", max_len=MAX_LEN, bucket=BUCKET)
    inputs = B.example_inputs(config, build, 1)
    assert graph.model.nxd_model.router(inputs) == ("decode_sparse", 0)
    int64 = tuple(t.long() if t.dtype == torch.int32 else t for t in inputs)
    with pytest.raises(RuntimeError, match=r"'int32'.*'int64'"):
        graph(*int64)
    with pytest.raises(ValueError, match=r"input_shape_map"):
        graph(*B.example_inputs(config, build, 3))


def test_two_graphs_of_one_shape_reach_only_the_last_added(emulated_sdk, cores, tmp_path):
    """ModelBuilder routes by input shapes: a second decode graph of the same shapes hides the
    first."""
    builder_cls = emulated_sdk.ModelBuilder

    class Instance(emulated_sdk.BaseModelInstance):
        def __init__(self, scale):
            super().__init__(module_cls=None, input_output_aliases={})
            self.scale = scale

        def load_module(self):
            self.module = Scale(self.scale)

    class Scale(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((4,), float(scale)), requires_grad=False)

        def forward(self, x):
            return x * self.weight

    builder = builder_cls(
        router=None,
        tp_degree=2,
        checkpoint_loader=lambda: {"weight": torch.ones(4)},
        compiler_workdir=str(tmp_path),
    )
    builder.add("decode_dense", Instance(2), [(torch.ones(1, 4),)])
    builder.add("decode_sparse", Instance(3), [(torch.ones(1, 4),)])
    executor = builder.trace(initialize_model_weights=True)
    assert executor.nxd_model.router([torch.ones(1, 4)]) == ("decode_sparse", 0)
    assert list(executor.nxd_model.shape_map.values()) == [("decode_sparse", 0)]


def _build(tmp_path, **fields) -> B.NeuronBuildConfig:
    return B.NeuronBuildConfig(
        model_dir=str(TP2_CHECKPOINT_DIR),
        output_dir=str(tmp_path / "a"),
        max_len=MAX_LEN,
        bucket=BUCKET,
        **fields,
    )


def test_the_checkpoint_is_converted_once_and_mapped_after(
    emulated_sdk, cores, tmp_path, monkeypatch
):
    reads = []
    real = B.read_hf_state
    monkeypatch.setattr(
        B, "read_hf_state", lambda model_dir, only=None: reads.append(only) or real(model_dir, only)
    )
    build = _build(tmp_path, decode_experts="sparse")
    record = B.compile_neuron(build, sample_interval_s=0.05)
    # the layer scalars, then the whole checkpoint once, at the early shard check; trace()'s own
    # sharding maps the int8 file that pass wrote
    assert [only is None for only in reads] == [False, True]
    converted = build.scratch_dir() / B.CONVERTED_FILE
    assert converted.is_file() and record["compiler_workdir_bytes"] > converted.stat().st_size
    saved = B.checkpoint_loader(build, B.text_config(TP2_CHECKPOINT_DIR))()
    assert saved["lm.model.layers.0.experts.gate_up.weight"].dtype == torch.int8
    assert host.anonymous_bytes(saved.values()) == 0  # memory-mapped, not copied


def test_a_renamed_weight_stops_the_build_before_the_compile(
    emulated_sdk, cores, tmp_path, monkeypatch
):
    real = B.convert_checkpoint

    def renamed(*args, **kwargs):
        state = real(*args, **kwargs)
        state["lm.model.final_norm.weight"] = state.pop("lm.model.norm.weight")
        return state

    monkeypatch.setattr(B, "convert_checkpoint", renamed)
    build = _build(tmp_path)
    with pytest.raises(ValueError, match=r"rank-0 shard has no 'lm\.model\.norm\.weight'.*hub"):
        B.compile_neuron(build, sample_interval_s=0.05)
    assert not Path(build.compiler_workdir).exists() and not spmd.cores().traced


def test_an_unknown_compiler_flag_fails_the_compile(emulated_sdk, cores, tmp_path):
    from gemma_nb.rehearsal.nxd_builder import check_compiler_args

    # neuron-cc's (Inferentia 1) --fast-math is no neuronx-cc option
    build = _build(tmp_path, compiler_args="--model-type transformer --fast-math none -O1")
    with pytest.raises(RuntimeError, match="unrecognized arguments: --fast-math"):
        B.compile_neuron(build, sample_interval_s=0.05)
    with pytest.raises(RuntimeError, match="unrecognized arguments: --auto-cast bf16$"):
        check_compiler_args("--auto-cast bf16")  # a value the option does not take
    with pytest.raises(RuntimeError, match="unrecognized arguments: x$"):
        check_compiler_args("--auto-cast=allx")
    check_compiler_args(B.COMPILER_ARGS + " --auto-cast-type bf16 --verbose=35")


def test_kv_aliases_in_bf16_fail_the_compile(emulated_sdk, cores, tmp_path, monkeypatch):
    real = B.write_positions
    monkeypatch.setattr(B, "write_positions", lambda *args: real(*args).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"'bfloat16'.*'k_cache\.0'.*'float32'"):
        B.compile_neuron(_build(tmp_path), sample_interval_s=0.05)


def test_two_builds_in_one_process_fail(emulated_sdk, cores, tmp_path):
    B.compile_neuron(_build(tmp_path), sample_interval_s=0.05)
    with pytest.raises(RuntimeError, match="trace already ran in this process.*its own process"):
        B.compile_neuron(_build(tmp_path / "b"), sample_interval_s=0.05)


def _deploy_in_a_process(artifact, budget_bytes: int):
    """``slim_deploy(artifact)`` in a fresh process whose box has ``budget_bytes`` of RAM + swap."""
    import subprocess

    box = json.loads(box_environments()["serving"][host.ENV]) | {"budget_bytes": budget_bytes}
    code = f"from gemma_nb.neuron.deploy import slim_deploy; slim_deploy({str(artifact)!r})"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(SDK_PATH), os.environ.get("PYTHONPATH", "")]),
            host.ENV: json.dumps(box),
            "OMP_NUM_THREADS": "1",
        },
    )


def test_a_serving_box_without_swap_is_oom_killed_at_jit_load(builds):
    from gemma_nb.hardware import INSTANCES

    root, _ = builds
    no_swap = _deploy_in_a_process(root / "sparse", INSTANCES["inf2.xlarge"].host_ram_bytes)
    assert no_swap.returncode == -9, no_swap.stderr[-2000:]
    assert re.search(
        r"Out of memory: Killed process \d+ .*torch\.jit\.load of model\.pt", no_swap.stderr
    )
    recipe = json.loads(box_environments()["serving"][host.ENV])["budget_bytes"]
    assert _deploy_in_a_process(root / "sparse", recipe).returncode == 0


def test_compiler_flags_warn_for_the_port_s_auto_cast_only(emulated_sdk, caplog):
    from gemma_nb.rehearsal.nxd_builder import AUTO_CAST_WARNING, append_default_compiler_flags

    with caplog.at_level(logging.WARNING, logger="Neuron"):
        both = append_default_compiler_flags(B.COMPILER_ARGS)
        assert AUTO_CAST_WARNING not in caplog.text
        append_default_compiler_flags("--model-type transformer --auto-cast all -O1")  # the port's
        assert AUTO_CAST_WARNING in caplog.text
    assert both == "--model-type transformer --auto-cast=none -O1 --verbose=35"


def test_a_checkpoint_without_an_int8_scale_fails_the_shard_check(
    emulated_sdk, cores, tmp_path, monkeypatch
):
    real = B.convert_checkpoint

    def without_a_scale(*args, **kwargs):
        state = real(*args, **kwargs)
        del state["lm.model.layers.2.experts.down.scale"]
        return state

    monkeypatch.setattr(B, "convert_checkpoint", without_a_scale)
    build = B.NeuronBuildConfig(
        model_dir=str(TP2_CHECKPOINT_DIR),
        output_dir=str(tmp_path / "a"),
        max_len=MAX_LEN,
        bucket=BUCKET,
    )
    with pytest.raises(RuntimeError, match=r"lm\.model\.layers\.2\.experts\.down\.scale"):
        B.compile_neuron(build, sample_interval_s=0.05)


def test_the_lm_head_alone_on_two_emulated_cores_equals_the_unsharded_int8_head(
    emulated_sdk, cores
):
    from gemma_nb.neuron.lm_head import compile_lm_head
    from gemma_nb.quant import Int8Linear

    torch.manual_seed(0)
    embedding = torch.randn(101, 64)  # 101 rows: the padded split
    hidden = torch.randn(1, 5, 64).bfloat16()
    head = compile_lm_head(embedding, tp=2, tokens=5)
    assert torch.equal(head(hidden)[..., :101], Int8Linear.from_weight(embedding)(hidden))


def test_quantization_trials_record_what_the_emulation_runs_and_refuses(emulated_sdk, cores):
    from gemma_nb.neuron import quantized_dtypes as quant

    trials = quant.run_trials(in_features=64, out_features=32, tokens=2).set_index("dtype")
    assert bool(trials.loc["INT8", "ok"]) and trials.loc["INT8", "max_abs_diff"] < 1e-2
    assert trials.loc["F4E2M1FN_X4", "stage"] == "build"
    assert "emulated SDK" in trials.loc["F4E2M1FN_X4", "error"]
