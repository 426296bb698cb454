"""Emulated NeuronCores: one thread per rank, collectives as torch custom ops between them, an HBM
budget: ``GEMMA_NB_EMULATED_NEURON_CORES`` cores (2) of ``GEMMA_NB_EMULATED_HBM_BYTES`` (16 GiB)
each, plus ``GEMMA_NB_EMULATED_RUNTIME_BYTES`` per loaded model; memory comes back only when the
process exits."""

import contextlib
import os
import threading
from dataclasses import dataclass, field

import torch

DEFAULT_HBM_BYTES = 16 * 2**30  # one inf2 NeuronCore-v2
DEFAULT_CORES = 2  # an inf2.xlarge / inf2.8xlarge


class _Group:
    """The rendezvous of ``size`` rank threads: each puts its tensor in a slot, all read every
    slot."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return gathered


# .context: (group, rank) on a core thread; .tracing: the tp of a program being traced
_LOCAL = threading.local()


@contextlib.contextmanager
def tracing(tp: int):
    """While a program is traced for ``tp`` cores: collectives return placeholders of the right
    shape."""
    previous, _LOCAL.tracing = getattr(_LOCAL, "tracing", None), tp
    try:
        yield
    finally:
        _LOCAL.tracing = previous


def _exchange(name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every core's ``tensor`` in rank order; while a program is traced, ``tensor`` and zeros
    (placeholders)."""
    context = getattr(_LOCAL, "context", None)
    if context is not None:
        return context[0].exchange(context[1], tensor)
    tp = getattr(_LOCAL, "tracing", None)
    if tp is None:
        raise RuntimeError(
            f"{name}: a collective of the emulated NeuronCores ran outside a core; run the "
            "program with gemma_nb.rehearsal.spmd.run_on_cores (or trace it inside spmd.tracing)"
        )
    return [tensor, *[torch.zeros_like(tensor)] * (tp - 1)]


def _all_reduce_impl(tensor: torch.Tensor) -> torch.Tensor:
    parts = _exchange("all_reduce", tensor)
    return sum(parts[1:], parts[0].clone())


def _all_gather_impl(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat(_exchange("all_gather", tensor), dim=dim).contiguous()


_LIBRARY = torch.library.Library("nxd_emulated", "DEF")
_LIBRARY.define("all_reduce(Tensor x) -> Tensor")
_LIBRARY.define("all_gather(Tensor x, int dim) -> Tensor")
_LIBRARY.impl("all_reduce", _all_reduce_impl, "CPU")
_LIBRARY.impl("all_gather", _all_gather_impl, "CPU")


def run_on_cores(jobs: list) -> list:
    """Run ``jobs[r]()`` on emulated core r, all at once (one thread each); their results, in rank
    order."""
    group, results, errors = _Group(len(jobs)), [None] * len(jobs), []

    def work(rank: int) -> None:
        _LOCAL.context = (group, rank)
        try:
            results[rank] = jobs[rank]()
        except BaseException as error:  # noqa: BLE001
            # handed to the caller below, a broken barrier's last
            errors.append((isinstance(error, threading.BrokenBarrierError), rank, error))
            group.barrier.abort()
        finally:
            _LOCAL.context = None

    threads = [
        threading.Thread(target=work, args=(rank,), name=f"emulated-core-{rank}")
        for rank in range(len(jobs))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise sorted(errors, key=lambda e: (e[0], e[1]))[0][2]
    return results


class AllocationError(RuntimeError):
    """The Neuron runtime's allocation failure (``status=4 Allocation Failure``), emulated."""


@dataclass
class Cores:
    """The NeuronCores of this process and the bytes each holds, per loaded model."""

    count: int = DEFAULT_CORES
    hbm_bytes: int = DEFAULT_HBM_BYTES
    runtime_bytes: int = 0  # per loaded model and core
    held: dict = field(default_factory=dict)  # loaded model -> bytes per core (list)
    traced: bool = False  # ModelBuilder.trace ran in this process

    def used(self, core: int) -> int:
        return sum(per_core[core] for per_core in self.held.values() if core < len(per_core))

    def allocate(self, model, bytes_per_core: list[int], start_rank: int = 0) -> None:
        """Hold ``bytes_per_core[r]`` on core ``start_rank + r`` for ``model``, or raise
        ``AllocationError``."""
        if start_rank + len(bytes_per_core) > self.count:
            raise AllocationError(
                f"the model needs NeuronCores {start_rank}..{start_rank + len(bytes_per_core) - 1} "
                f"but this instance has {self.count} (emulated): use an instance with more cores"
            )
        self.held.pop(model, None)  # initialising a loaded model again replaces its allocation
        per_core = [0] * self.count
        for core, need in enumerate(bytes_per_core, start_rank):
            need += self.runtime_bytes
            if self.used(core) + need > self.hbm_bytes:
                raise AllocationError(
                    f"Failed to allocate {need:,} bytes on NeuronCore {core}: status=4 "
                    f"Allocation Failure (emulated HBM: {self.used(core):,} of "
                    f"{self.hbm_bytes:,} bytes already held by {len(self.held)} loaded model(s); "
                    "load each model in its own process)"
                )
            per_core[core] = need
        self.held[model] = per_core


_CORES: Cores | None = None


def cores() -> Cores:
    """This process's emulated NeuronCores (sized from the environment on first use)."""
    global _CORES
    if _CORES is None:
        _CORES = Cores(
            count=int(os.environ.get("GEMMA_NB_EMULATED_NEURON_CORES", DEFAULT_CORES)),
            hbm_bytes=int(os.environ.get("GEMMA_NB_EMULATED_HBM_BYTES", DEFAULT_HBM_BYTES)),
            runtime_bytes=int(os.environ.get("GEMMA_NB_EMULATED_RUNTIME_BYTES", 0)),
        )
    return _CORES
