"""Workers for tests/test_parallel.py's failing 2-rank jobs. spawn imports a worker's module by
name in each rank: this one imports torch alone, not the package (seconds less per rank)."""

import os
import time

import torch
import torch.distributed as dist


def _gather_once() -> None:
    parts = [torch.empty(4) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, torch.zeros(4))


def raising_job(rank: int, world_size: int) -> dict:
    if rank == 1:
        raise RuntimeError("injected failure in rank 1")
    _gather_once()
    return {}


def dying_job(rank: int, world_size: int) -> dict:
    if rank == 1:
        os._exit(7)
    _gather_once()
    return {}


def stuck_job(rank: int, world_size: int) -> dict:
    if rank == 1:
        time.sleep(120)
    _gather_once()
    return {}
