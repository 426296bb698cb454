"""NxDModel, its saved artifact and ``torch.jit.load``, emulated on the emulated NeuronCores: a call
is routed by its inputs' shapes (the last graph added wins); aliased outputs stay on the cores as
state."""

import json
import os
import warnings
from dataclasses import dataclass

# TorchScript (torch 2.9) reads no builtin generics in attributes
from typing import Dict, List  # noqa: UP035

import torch
from torch import nn

from gemma_nb.rehearsal import host, spmd

SAVED_MARKER = "gemma-nb emulated NxD model v1"


class _Graph(nn.Module):
    """What is traced: ``forward(*weights, *states, *inputs)`` runs the held module with those
    tensors as its parameters."""

    def __init__(self, module: nn.Module, names: list[str]):
        super().__init__()
        self._held = [module]  # not a submodule: its parameters must not be saved with the graph
        self.names = names

    def forward(self, *tensors):
        module, held = self._held[0], []
        for name, tensor in zip(self.names, tensors):
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            held.append((owner, leaf, owner._parameters[leaf]))
            owner._parameters[leaf] = tensor
        try:
            outputs = module(*tensors[len(self.names) :])
        finally:  # the module's own parameters back
            for owner, leaf, parameter in held:
                owner._parameters[leaf] = parameter
        return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def _meta(tensor: torch.Tensor) -> list:
    return [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]


def check_alias(index: int, output: torch.Tensor, name: str, state: torch.Tensor) -> None:
    """XLA aliases an output only to an input of its shape and dtype."""
    if _meta(output) != _meta(state):
        raise RuntimeError(
            f"output {index} is {_meta(output)}, the input it aliases, {name!r}, is "
            f"{_meta(state)}: an aliased output must have its input's shape and dtype"
        )


def trace_graph(module: nn.Module, example_inputs: tuple, aliases: dict, tp: int) -> dict:
    """``module`` traced for the emulated cores: ``{"program": ScriptModule, "spec": {...}}``."""
    parameters = dict(module.named_parameters())
    names = {id(p): name for name, p in parameters.items()}
    state_names = [names[id(p)] for p in aliases]
    weight_names = [name for name in parameters if name not in state_names]
    tensors = [parameters[n] for n in weight_names + state_names]
    graph = _Graph(module.eval(), weight_names + state_names)
    with torch.no_grad(), spmd.tracing(tp), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.jit.trace(
            graph, (*tensors, *example_inputs), strict=False, check_trace=False
        )
        outputs = graph(*tensors, *example_inputs)
    for state, index in aliases.items():
        check_alias(index, outputs[index], names[id(state)], state)
    spec = {
        "weights": {n: _meta(parameters[n]) for n in weight_names},
        "states": {n: _meta(parameters[n]) for n in state_names},
        "inputs": [_meta(t) for t in example_inputs],
        "outputs": len(outputs),
        "aliases": {str(index): names[id(p)] for p, index in aliases.items()},
    }
    return {"program": program, "spec": spec}


def shape_key(inputs) -> str:
    """NxDModel's routing key: the inputs' shapes as TorchScript prints a ``List[List[int]]``."""
    return str([list(t.shape) for t in inputs])


class EmulatedNxDModel:
    """``executor.nxd_model``: the graphs, the router, the weights and the device state per rank."""

    def __init__(self, graphs: dict, shape_map: dict, tp: int, weights: list[dict] | None = None):
        self.graphs, self.shape_map, self.tp = graphs, shape_map, tp
        self.saved_weights = (
            weights  # the weights inside the artifact (initialize_with_saved_weights)
        )
        self.weights, self.states, self.loaded = None, None, False
        self.calls = dict.fromkeys(graphs, 0)

    def initialize(self, checkpoint: list[dict], start_rank_tensor: torch.Tensor) -> None:
        """Weights to the cores (checked against every graph), zeroed device state, HBM held."""
        if len(checkpoint) != self.tp:
            raise ValueError(
                f"{len(checkpoint)} rank checkpoints for a model traced for {self.tp} ranks"
            )
        for rank, shard in enumerate(checkpoint):
            for graph in self.graphs.values():
                for name, (shape, dtype) in graph["spec"]["weights"].items():
                    if name not in shard:
                        raise RuntimeError(
                            f"rank {rank}: the checkpoint holds no weight {name!r} the graph needs"
                        )
                    if _meta(shard[name]) != [shape, dtype]:
                        raise RuntimeError(
                            f"rank {rank}: weight {name!r} is {tuple(shard[name].shape)} "
                            f"{shard[name].dtype}, the graph was traced with {tuple(shape)} {dtype}"
                        )
        specs = [g["spec"]["states"] for g in self.graphs.values()]
        states = [
            {
                name: torch.zeros(shape, dtype=getattr(torch, dtype))
                for spec in specs
                for name, (shape, dtype) in spec.items()
            }
            for _ in range(self.tp)
        ]
        need = [
            sum(t.numel() * t.element_size() for t in (*w.values(), *s.values()))
            for w, s in zip(checkpoint, states)
        ]
        spmd.cores().allocate(self, need, int(start_rank_tensor))
        self.weights, self.states, self.loaded = checkpoint, states, True

    def initialize_with_saved_weights(self, start_rank_tensor: torch.Tensor) -> None:
        # none saved: "0 rank checkpoints" for tp ranks
        self.initialize(self.saved_weights or [], start_rank_tensor)

    def router(self, inputs) -> tuple[str, int]:
        key = shape_key(inputs)
        if key not in self.shape_map:
            raise ValueError(
                f"Input shape {key} not found in input_shape_map: {list(self.shape_map)}"
            )
        return tuple(self.shape_map[key])

    def __call__(self, inputs: list) -> list:
        if not self.loaded:
            raise ValueError(
                "This model is not initialized, please call "
                "traced_model.nxd_model.initialize(sharded_checkpoint) or "
                "traced_model.nxd_model.initialize_with_saved_weights()"
            )
        name, _ = self.router(inputs)
        graph = self.graphs[name]
        spec = graph["spec"]
        traced, given = [dtype for _, dtype in spec["inputs"]], [_meta(t)[1] for t in inputs]
        if given != traced:
            raise RuntimeError(
                f"graph {name!r} was traced with input dtypes {traced}, called with {given}"
            )

        def job(rank):
            with torch.no_grad():
                return graph["program"](
                    *[self.weights[rank][n] for n in spec["weights"]],
                    *[self.states[rank][n] for n in spec["states"]],
                    *inputs,
                )

        per_rank = spmd.run_on_cores([lambda rank=rank: job(rank) for rank in range(self.tp)])
        aliases = {int(index): state for index, state in spec["aliases"].items()}
        for rank, outputs in enumerate(per_rank):
            for index, state in aliases.items():
                self.states[rank][state] = outputs[index]
        self.calls[name] += 1
        return [out for index, out in enumerate(per_rank[0]) if index not in aliases]


class Saved(nn.Module):
    """The TorchScript archive ``torch.jit.save`` writes: programs, each rank's weights, the
    spec."""

    weights: List[Dict[str, torch.Tensor]]  # noqa: UP006
    spec: str

    def __init__(self, programs: dict, weights: list, spec: str):
        super().__init__()
        self.programs, self.weights, self.spec = nn.ModuleDict(programs), weights, spec

    def forward(self, inputs: List[torch.Tensor]) -> List[torch.Tensor]:  # noqa: UP006
        # unknown unless the emulated SDK is imported
        return torch.ops.nxd_emulated.spmd_model(inputs)


@dataclass
class EmulatedExecutor:
    """What ``trace`` returns and ``torch.jit.load`` gives back: ``executor(*inputs)``,
    ``.nxd_model``, ``.save``."""

    nxd_model: EmulatedNxDModel

    def __call__(self, *inputs):
        return self.nxd_model(list(inputs))

    def save(self, path, _extra_files=None) -> None:
        model = self.nxd_model
        spec = {
            "marker": SAVED_MARKER,
            "tp": model.tp,
            "shape_map": model.shape_map,
            "graphs": {name: graph["spec"] for name, graph in model.graphs.items()},
        }
        saved = Saved(
            {name: graph["program"] for name, graph in model.graphs.items()},
            model.saved_weights or [],
            json.dumps(spec),
        )
        torch.jit.script(saved).save(str(path), _extra_files=_extra_files or {})


def executor_from_saved(module) -> EmulatedExecutor:
    spec = json.loads(module.spec)
    graphs = {
        name: {"program": getattr(module.programs, name), "spec": graph_spec}
        for name, graph_spec in spec["graphs"].items()
    }
    return EmulatedExecutor(
        EmulatedNxDModel(graphs, spec["shape_map"], spec["tp"], list(module.weights))
    )


_JIT_LOAD = torch.jit.load


def jit_load(path, *args, **kwargs):
    """``torch.jit.load`` (as the emulated ``trace.model_builder`` installs it): an emulated archive
    as its executor, its whole file held on the host (weights included) until the process exits."""
    module = _JIT_LOAD(path, *args, **kwargs)
    try:
        saved = json.loads(module.spec).get("marker") == SAVED_MARKER
    except (AttributeError, RuntimeError, ValueError):
        saved = False
    if not saved:
        return module
    ledger = host.ledger()
    ledger.hold("torch.jit.load of model.pt", os.path.getsize(path) * ledger.scale, until_exit=True)
    return executor_from_saved(module)


def _marker_op(inputs):
    raise RuntimeError(
        "an emulated NxD artifact runs through the emulated runtime: torch.jit.load it after "
        "importing neuronx_distributed.trace.model_builder"
    )


spmd._LIBRARY.define("spmd_model(Tensor[] inputs) -> Tensor[]")
spmd._LIBRARY.impl("spmd_model", _marker_op, "CPU")
