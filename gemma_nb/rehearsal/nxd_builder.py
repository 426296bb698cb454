"""ModelBuilder v1 and v2 emulated (NxD 0.18's ``trace/model_builder*.py``): shard, trace, load on
the cores; each graph is traced with ``torch.jit.trace`` (``nxd_model``) instead of HLO and
neuronx-cc, and no NEFF is written. What the host holds goes to the box's ledger (``host``)."""

import logging
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gemma_nb.rehearsal import host, nxd_layers, nxd_model, spmd
from gemma_nb.rehearsal.nxd_layers import ParallelState, use_state
from gemma_nb.rehearsal.sharding import init_on_meta, shard_checkpoint

logger = logging.getLogger("Neuron")
AUTO_CAST_WARNING = (
    "Compiler argument ``--auto-cast=none`` not detected. Other values might "
    "result in lower accuracy"
)
SHARD_FILE = "tp{rank}_sharded_checkpoint.safetensors"
# neuronx-cc compile's options and values as the repo cites them (docs/sources.md, neuronx-cc-cli)
NEURONX_CC_OPTIONS = re.compile(
    r"--model-type[= ](generic|transformer|unet-inference)|--auto-cast[= ](none|matmult|all)"
    r"|--auto-cast-type[= ](bf16|fp16|tf32|fp8_e4m3)|(-O|--optlevel[= ])[123]"
    r"|--logical-nc-config[= ][12]|--(logfile|verbose)[= ]\S+|--enable-(saturate-infinity"
    r"|mixed-precision-accumulation|fast-context-switch|fast-loading-neuron-binaries)"
)


def append_default_compiler_flags(compiler_args: str | None = "") -> str:
    """NxD's completion of the compiler flags (``trace/model_builder.py``), with its warning."""
    if not compiler_args:
        compiler_args = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
    if "--auto-cast" not in compiler_args:
        compiler_args += " --auto-cast=none "
    elif "--auto-cast=none" not in compiler_args:
        logger.warning(AUTO_CAST_WARNING)
    if not re.search(r"-O\d+", compiler_args):
        compiler_args += " -O1 "
    if "--verbose" not in compiler_args:
        compiler_args += " --verbose=35"
    return compiler_args


def check_compiler_args(compiler_args: str) -> None:
    """neuronx-cc's refusal of an option or value it does not take (its argument parser's)."""
    unknown = " ".join(NEURONX_CC_OPTIONS.sub(" ", f" {compiler_args} ").split())
    if unknown:
        raise RuntimeError(f"neuronx-cc: error: unrecognized arguments: {unknown}")


def _shard_all(model, checkpoint: dict, tp: int, serialize_path=None) -> list[dict]:
    shards = [shard_checkpoint(model, checkpoint, rank, tp) for rank in range(tp)]
    # the loader's tensors a file does not back, and the shards (NxD's own copies): at once
    shard_bytes = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    ledger = host.ledger()
    ledger.hold(
        "the checkpoint and its shards",
        (host.anonymous_bytes(checkpoint.values()) + shard_bytes) * ledger.scale,
    )
    if serialize_path is not None:
        Path(serialize_path).mkdir(parents=True, exist_ok=True)
        for rank, shard in enumerate(shards):
            save_file(
                {k: v.contiguous() for k, v in shard.items()},
                str(Path(serialize_path) / SHARD_FILE.format(rank=rank)),
            )
    return shards


class BaseModelInstance:
    """NxD's ``BaseModelInstance``: ``load_module()`` sets ``module``; ``get()`` returns it with its
    aliases."""

    def __init__(self, module_cls, input_output_aliases):
        self.module_cls, self.module = module_cls, None
        self.input_output_aliases = [input_output_aliases]

    def load_module(self):
        self.module = self.module_cls()

    def get(self, bucket_rank, **kwargs):
        return self.module, self.input_output_aliases[0]


class ModelBuilder:  # v1 (trace/model_builder.py)
    def __init__(
        self, router, tp_degree: int, checkpoint_loader, *, compiler_workdir=None, **unsupported
    ):
        if unsupported:  # start_rank_id among them: the emulated cores start at 0
            raise TypeError(f"the emulated ModelBuilder does not implement {sorted(unsupported)}")
        self.router, self.tp_degree, self.checkpoint_loader = router, tp_degree, checkpoint_loader
        self.compiler_workdir, self.model_collection = compiler_workdir or "/tmp/nxd_model/", {}

    def add(
        self,
        key: str,
        model_instance,
        example_inputs: list,
        compiler_args: str | None = None,
        bucket_config=None,
        priority_model_idx=None,
    ):
        if bucket_config is not None or priority_model_idx is not None or len(example_inputs) != 1:
            raise TypeError(
                "the emulated ModelBuilder does not implement bucketing (bucket_config, "
                f"priority_model_idx, {len(example_inputs)} example inputs): give one example "
                "per key"
            )
        self.model_collection[key] = {
            "instance": model_instance,
            "example_inputs": example_inputs,
            "compiler_args": append_default_compiler_flags(compiler_args),
        }
        return self

    def shard_checkpoint(self, serialize_path=None) -> list[dict]:
        instance = next(iter(self.model_collection.values()))["instance"]
        # NxD's initialize_model_parallel
        with (
            use_state(ParallelState(self.tp_degree, spmd=True)),
            init_on_meta(),
        ):
            instance.load_module()
            model, _ = instance.get(0)
            return _shard_all(model, self.checkpoint_loader(), self.tp_degree, serialize_path)

    def trace(self, initialize_model_weights: bool = True, dry_run: bool = False):
        if dry_run:
            raise TypeError("the emulated ModelBuilder does not implement dry_run")
        if spmd.cores().traced:
            raise RuntimeError(
                "ModelBuilder.trace already ran in this process: NxD traces in another process to "
                "release the Neuron runtime (trace/model_builder.py); start each build in its own "
                "process"
            )
        spmd.cores().traced = True
        workdir = Path(self.compiler_workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        graphs, shape_map = {}, {}
        with use_state(ParallelState(self.tp_degree, spmd=True)):
            for key, entry in self.model_collection.items():
                instance = entry["instance"]
                instance.load_module()
                module, aliases = instance.get(0)
                example = tuple(entry["example_inputs"][0])  # one bucket per key (add refuses more)
                check_compiler_args(entry["compiler_args"])
                graphs[key] = nxd_model.trace_graph(module, example, aliases, self.tp_degree)
                shape_map[nxd_model.shape_key(example)] = (key, 0)
                instance.module = None
        ledger = host.ledger()
        ledger.hold("neuronx-cc (the port's compile peak)", ledger.compile_bytes)
        model = nxd_model.EmulatedNxDModel(graphs, shape_map, self.tp_degree)
        if initialize_model_weights:
            self.shard_checkpoint(self.compiler_workdir)
            model.saved_weights = [
                load_file(str(workdir / SHARD_FILE.format(rank=rank)))
                for rank in range(self.tp_degree)
            ]
            model.initialize_with_saved_weights(torch.tensor([0], dtype=torch.int32))
        return nxd_model.EmulatedExecutor(model)


def NxDParallelState(
    world_size: int = 1, rank: int = 0, tensor_model_parallel_size: int = 1, **unsupported
):
    """``with NxDParallelState(world_size=tp, tensor_model_parallel_size=tp):`` the parallel state
    for building."""
    if unsupported or world_size != tensor_model_parallel_size:
        raise TypeError(
            "the emulated NxDParallelState keeps tensor parallelism only (world_size == "
            f"tensor_model_parallel_size), got world_size={world_size}, {sorted(unsupported)}"
        )
    return use_state(ParallelState(tensor_model_parallel_size, spmd=True))


class NxDModelV2:
    """v2's ``NxDModel``: ``set_weights``, ``to_neuron``, then ``model(*args)`` (outputs of rank
    0)."""

    def __init__(self, model: nxd_model.EmulatedNxDModel):
        self._model, self._weights = model, None

    def set_weights(self, sharded_checkpoint: list[dict]) -> None:
        if self._model.loaded:
            raise ValueError(
                "set_weights() was called when the model was already loaded on neuron. If you "
                "need to replace your weights, call `replace_weights()` instead."
            )
        self._weights = sharded_checkpoint

    def to_neuron(self) -> None:
        if not self._model.loaded:
            self._model.initialize(self._weights or [], torch.tensor([0], dtype=torch.int32))

    def __call__(self, *args):
        if not self._model.loaded:
            raise RuntimeError("Model not initialized. Call set_weights() followed by to_neuron()")
        outputs = self._model(list(args))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


class ModelBuilderV2:  # v2 (trace/model_builder_v2.py)
    def __init__(self, model, weights_to_skip_layout_optimization=None):
        self.model, self.graphs, self.shape_map, self.tp = model, {}, {}, None

    def trace(self, args=None, kwargs=None, tag: str | None = None, spmd: bool = True):
        state = nxd_layers.STATE
        assert state is not None, (
            "NxD parallel state has not been initialized: trace inside NxDParallelState(...)"
        )
        if kwargs:
            raise TypeError("the emulated ModelBuilder v2 traces positional arguments only")
        args = args if isinstance(args, tuple) else (args,)
        tag = tag or f"graph_{len(self.graphs)}"
        self.graphs[tag] = nxd_model.trace_graph(self.model, args, {}, state.tp)
        self.shape_map[nxd_model.shape_key(args)], self.tp = (tag, 0), self.tp or state.tp
        return self

    def compile(
        self, priority_model_key=None, compiler_workdir=None, compiler_args=None, max_workers=None
    ):
        if not self.graphs:
            raise ValueError("No traces available for compilation. Call trace() first.")
        return NxDModelV2(
            nxd_model.EmulatedNxDModel(dict(self.graphs), dict(self.shape_map), self.tp)
        )


def shard_checkpoint_v2(
    checkpoint: dict,
    model,
    start_rank=None,
    end_rank=None,
    load_on_device: bool = False,
    serialize_path=None,
) -> list[dict]:
    """``neuronx_distributed.shard_checkpoint`` (``trace/functions.py``): every rank of the parallel
    state."""
    state = nxd_layers.STATE
    assert state is not None, "NxD parallel state has not been initialized"
    if load_on_device or start_rank not in (None, 0) or end_rank not in (None, state.tp - 1):
        raise TypeError("the emulated shard_checkpoint cuts every rank, on the host")
    return _shard_all(model, checkpoint, state.tp, serialize_path)
