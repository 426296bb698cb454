"""Run a function on tensor-parallel ranks: real gloo processes on 127.0.0.1 (notebook 03, the TP=2
rehearsal). Workers must be importable by name (spawn pickles them), not defined in a notebook."""

import contextlib
import os
import pickle
import queue as queue_module
import signal
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOOPBACK = "127.0.0.1"
# gloo's words when a collective lost its peer: a consequence of another rank's failure.
_PEER_LOSS = ("closed by peer", "reset by peer", "timed out", "broken pipe")


class TPJobError(RuntimeError):
    """A rank raised, died or hung; the message names each rank that failed and why, causes
    first."""


def free_port() -> int:
    """A TCP port on the loopback address that was free a moment ago (for the rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    fn: Callable,
    args: tuple,
    world_size: int,
    port: int,
    results,
    collective_timeout_s: float,
    threads: int,
) -> None:
    """Entry point of one spawned rank: join the gloo group, run ``fn``, post its result or
    error."""
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend="gloo",
            init_method=f"tcp://{LOOPBACK}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        result = fn(rank, world_size, *args)
        if not isinstance(result, dict):
            raise TypeError(
                f"worker {fn.__qualname__} returned {type(result).__name__}; expected a dict"
            )
        # Plain pickle: tensors travel by value, not as shared-memory handles that die with this
        # process.
        results.put((rank, "ok", pickle.dumps(result)))
    except BaseException as error:  # noqa: BLE001 - everything is reported to the parent
        results.put(
            (rank, "error", f"{type(error).__name__}: {error}".strip(), traceback.format_exc())
        )
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exited with code {code} without reporting a result"
    try:
        return f"killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def run_tp(
    fn: Callable[..., dict],
    args: Sequence[Any] = (),
    *,
    world_size: int = 2,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
    failure_grace_s: float = 5.0,
    threads_per_rank: int | None = None,
) -> list[dict]:
    """Run ``fn(rank, world_size, *args) -> dict`` on ``world_size`` gloo ranks; return the dicts by
    rank. ``TPJobError`` after ``timeout_s``, or ``failure_grace_s`` after a first failure, the
    ranks stopped."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(
            f"world_size={world_size!r} must be a positive integer (2 for the port's TP=2)"
        )
    if timeout_s <= 0 or collective_timeout_s <= 0:
        raise ValueError(
            f"timeouts must be positive; got timeout_s={timeout_s}, "
            f"collective_timeout_s={collective_timeout_s}"
        )
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__") or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"worker {qualname or fn!r} (module {module!r}) cannot be started with spawn: the "
            "ranks import it by name, so it must be a top-level function of an importable "
            "module (a notebook or script defines its functions in __main__); move it into a "
            "module such as gemma_nb.experiments.lm_head_sharding"
        )
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            name=f"tp-rank-{rank}",
            daemon=True,
            args=(rank, fn, tuple(args), world_size, port, results, collective_timeout_s, threads),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    start = time.monotonic()
    try:
        done, failures, missing = _collect(results, procs, start, timeout_s, failure_grace_s)
    finally:
        for proc in procs:
            proc.terminate()  # a no-op on a rank that has exited
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
    if failures or missing:
        raise TPJobError(
            _failure_report(
                fn.__qualname__, world_size, time.monotonic() - start, failures, missing, timeout_s
            )
        )
    return [done[r] for r in range(world_size)]


def _collect(results, procs, start: float, timeout_s: float, failure_grace_s: float):
    """(results by rank, failures as they came, silent ranks) until all report, ``failure_grace_s``
    past a failure, or timeout."""
    done: dict[int, dict] = {}
    failures: list[tuple[int, str, str]] = []
    deadline = start + timeout_s  # brought forward to failure_grace_s past the first failure

    def reported(rank: int) -> bool:
        return rank in done or any(r == rank for r, _, _ in failures)

    def take(message) -> None:  # (rank, "ok", pickled dict) or (rank, "error", reason, traceback)
        nonlocal deadline
        if message[1] == "ok":
            done[message[0]] = pickle.loads(message[2])
        else:
            rank, _, reason, trace = message
            failures.append((rank, reason, trace))
            deadline = min(deadline, time.monotonic() + failure_grace_s)

    while not all(reported(r) for r in range(len(procs))):
        with contextlib.suppress(queue_module.Empty):
            take(results.get(timeout=0.1))
            continue
        for rank, proc in enumerate(procs):
            if not proc.is_alive() and not reported(rank):
                # A rank that posted just before exiting: drain before calling it dead.
                with contextlib.suppress(queue_module.Empty):
                    while True:
                        take(results.get(timeout=0.2))
                if not reported(rank):
                    take((rank, "error", _exit_reason(proc.exitcode), ""))
        if time.monotonic() > deadline:
            break
    return done, failures, [r for r in range(len(procs)) if not reported(r)]


def _failure_report(
    name: str,
    world_size: int,
    elapsed: float,
    failures: list[tuple[int, str, str]],
    missing: list[int],
    timeout_s: float,
) -> str:
    """Causes first (a rank's own error or death), then ranks that failed waiting on them, then
    stuck ranks."""
    consequences = [f for f in failures if any(words in f[1].lower() for words in _PEER_LOSS)]
    causes = [f for f in failures if f not in consequences]
    lines = [f"tensor-parallel job {name} failed after {elapsed:.1f} s (world size {world_size}):"]
    lines += [f"  rank {rank}: {reason}" for rank, reason, _ in causes]
    lines += [
        f"  rank {rank} (waiting on a failed or stuck peer): {reason}"
        for rank, reason, _ in consequences
    ]
    why = "after the failure above" if failures else f"at timeout_s={timeout_s:g}"
    lines += [f"  rank {rank} was still running (stuck?) and was stopped {why}" for rank in missing]
    if traced := [(rank, trace) for rank, _, trace in causes + consequences if trace]:
        lines.append(f"traceback of rank {traced[0][0]}:\n{traced[0][1].rstrip()}")
    return "\n".join(lines)
