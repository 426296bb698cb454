"""Peak host memory of a process and its children (``neuronx-cc``), sampled on a thread (notebooks
04, 05): the largest summed RSS of a tick, and the sum of each process's ``VmHWM`` (never misses a
spike). Shared pages count in each."""

import contextlib
import json
import os
import subprocess
import tempfile
import threading
import time
from collections import namedtuple
from dataclasses import dataclass, field

import psutil


def _hwm_bytes(proc: psutil.Process, rss: int) -> int:
    """The process's peak RSS so far (``VmHWM`` in /proc/<pid>/status), else its ``rss`` where that
    is unreadable."""
    with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/status") as handle:
        return next(
            (int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:")), rss
        )
    return rss


# One tick: seconds since the sampler started, summed RSS of the tree, processes counted.
Sample = namedtuple("Sample", "t_s rss_bytes processes")


@dataclass
class HostMemorySampler:
    """Sample the RSS of process ``pid`` (default: this one) plus its descendants, as a context
    manager."""

    interval_s: float = 0.05
    pid: int | None = None
    samples: list[Sample] = field(default_factory=list, init=False)
    wall_s: float = field(default=0.0, init=False)
    peak_rss_bytes: int = field(default=0, init=False)
    peak_hwm_bytes: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        assert not isinstance(self.interval_s, bool) and self.interval_s > 0, (
            f"interval_s={self.interval_s!r}"
        )
        self._root = psutil.Process(os.getpid() if self.pid is None else self.pid)
        self._hwm: dict[tuple[int, float], int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def sample(self) -> None:
        total, counted, procs = 0, 0, [self._root]
        with contextlib.suppress(psutil.Error):
            procs += self._root.children(recursive=True)
        for proc in procs:
            try:
                rss = proc.memory_info().rss
                key = (proc.pid, proc.create_time())
            except psutil.Error:  # exited between listing and reading
                continue
            total += rss
            counted += 1
            self._hwm[key] = max(self._hwm.get(key, 0), _hwm_bytes(proc, rss))
        self.samples.append(Sample(time.perf_counter() - self._t0, total, counted))
        self.peak_rss_bytes = max(self.peak_rss_bytes, total)
        self.peak_hwm_bytes = max(self.peak_hwm_bytes, sum(self._hwm.values()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "HostMemorySampler":
        assert self._thread is None, "a HostMemorySampler runs once"
        self._t0 = time.perf_counter()
        self.sample()
        self._thread = threading.Thread(target=self._run, name="host-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
        self.wall_s = time.perf_counter() - self._t0


def self_peak_rss_bytes() -> int:
    """This process's own kernel high-water mark of RSS (``VmHWM``), in bytes: exact, no sampling
    interval."""
    return _hwm_bytes(psutil.Process(), psutil.Process().memory_info().rss)


# A child process run under the sampler: its JSON result, peaks, wall time and ticks.
MeasuredRun = namedtuple("MeasuredRun", "result peak_rss_bytes peak_hwm_bytes wall_s samples")


class MeasuredRunError(RuntimeError):
    """The measured child process failed; the message carries the tail of its stderr."""


def run_measured(
    argv: list[str], interval_s: float = 0.05, timeout_s: float = 600.0, env: dict | None = None
) -> MeasuredRun:
    """Run ``argv`` as a fresh process, sampling its tree's RSS until it exits; its last stdout line
    is the JSON ``result``. ``MeasuredRunError`` (with the child's stderr tail) if it fails or runs
    past ``timeout_s``."""
    name = f"{' '.join(argv[:3])} ..."
    with tempfile.TemporaryFile(mode="w+") as err:
        child = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})}
        )
        with HostMemorySampler(interval_s=interval_s, pid=child.pid) as sampler:
            try:
                stdout, _ = child.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                raise MeasuredRunError(f"{name} ran past timeout_s={timeout_s}; it was killed")
        err.seek(0)
        stderr_tail = err.read()[-2000:]
    if child.returncode != 0:
        raise MeasuredRunError(f"{name} exited with status {child.returncode}:\n{stderr_tail}")
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        return MeasuredRun(
            json.loads(lines[-1]),
            sampler.peak_rss_bytes,
            sampler.peak_hwm_bytes,
            sampler.wall_s,
            sampler.samples,
        )
    except (IndexError, json.JSONDecodeError) as error:
        got = lines[-1][:200] if lines else "nothing"
        raise MeasuredRunError(
            f"{name} printed no JSON result on its last stdout line (got {got!r})"
        ) from error
