"""The emulated box's host memory: what a process holds at the 26B's scale against the box's RAM +
swap, as ``GEMMA_NB_EMULATED_HOST`` (JSON, set by the rehearsal per box) says: ``budget_bytes``,
``scale`` (the 26B's device weight bytes per byte of the smoke build's), ``compile_bytes`` (the
compile's own peak); ``GEMMA_NB_EMULATED_HOST_LOG``: where each process writes its peak. Over
budget, the process is killed as the OOM killer would; unset, nothing is enforced."""

import json
import os
import signal
import sys
from pathlib import Path

import psutil

ENV, LOG_ENV = "GEMMA_NB_EMULATED_HOST", "GEMMA_NB_EMULATED_HOST_LOG"


def anonymous_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` that no file backs (``/proc/self/maps``): a
    memory-mapped file is pages the kernel can drop and read again; the rest needs RAM or swap."""
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    files = [[int(at, 16) for at in m[0].split("-")] for m in maps if len(m) > 5 and m[5][0] == "/"]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for at, n in storages.items() if not any(lo <= at < hi for lo, hi in files))


class HostLedger:
    """This process's holdings (label -> bytes at the 26B's scale) on top of its own RSS."""

    def __init__(self, budget_bytes=None, scale=1.0, compile_bytes=0):
        self.budget_bytes, self.scale, self.compile_bytes = budget_bytes, scale, compile_bytes
        self.log_dir, self.held, self.peak_bytes = os.environ.get(LOG_ENV), {}, 0
        self.base_bytes = psutil.Process().memory_info().rss

    def hold(self, label: str, nbytes: float, until_exit: bool = False) -> None:
        """Hold ``nbytes`` at this instant (a transient peak) or ``until_exit`` (a loaded model:
        only the process's exit gives it back); over the budget, the process dies as the OOM
        killer kills it."""
        held = {**self.held, label: self.held.get(label, 0) + int(nbytes)}
        total = self.base_bytes + sum(held.values())
        if until_exit:
            self.held = held
        if total > self.peak_bytes and self.log_dir:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            entry = {"peak_bytes": total, "budget_bytes": self.budget_bytes, "held": held}
            (Path(self.log_dir) / f"{os.getpid()}.json").write_text(json.dumps(entry))
        self.peak_bytes = max(self.peak_bytes, total)
        if self.budget_bytes is not None and total > self.budget_bytes:
            print(
                f"Out of memory: Killed process {os.getpid()} ({Path(sys.argv[0]).name}) by the "
                f"emulated OOM killer: {label} brings it to {total / 1e9:.1f} GB at the 26B's "
                f"scale ({self.base_bytes / 1e9:.1f} GB of its own, "
                + ", ".join(f"{name} {n / 1e9:.1f} GB" for name, n in held.items())
                + f") on a box with {self.budget_bytes / 1e9:.1f} GB of RAM + swap",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)


_LEDGER: HostLedger | None = None


def ledger() -> HostLedger:
    """This process's ledger, configured from ``GEMMA_NB_EMULATED_HOST`` on first use."""
    global _LEDGER
    if _LEDGER is None:
        _LEDGER = HostLedger(**json.loads(os.environ.get(ENV, "{}")))
    return _LEDGER
