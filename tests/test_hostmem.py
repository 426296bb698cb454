"""The host-memory sampler sees the process, its children, and a child's peak."""

import subprocess
import sys
import time

import psutil
import pytest

from gemma_nb.peak_rss import HostMemorySampler, MeasuredRunError, run_measured, self_peak_rss_bytes

MB = 10**6
# A child that touches a known buffer (bytes of 1s, so every page is really resident), holds it,
# frees it, then reports its own peak.
CHILD = """
import json, sys, time
from gemma_nb.peak_rss import self_peak_rss_bytes
size = int(sys.argv[1])
buffer = b"\\x01" * size
time.sleep(0.4)
del buffer
time.sleep(0.2)
print("some log line")
print(json.dumps({"size": size, "self_peak": self_peak_rss_bytes()}))
"""


def test_sampler_sees_its_own_allocation():
    with HostMemorySampler(interval_s=0.01) as sampler:
        buffer = b"\x01" * (150 * MB)
        time.sleep(0.1)
        del buffer
    assert sampler.peak_rss_bytes - sampler.samples[0].rss_bytes > 140 * MB
    assert sampler.wall_s >= 0.1
    assert len(sampler.samples) >= 5
    assert sampler.peak_hwm_bytes >= sampler.peak_rss_bytes


def test_sampler_counts_children():
    # The parent allocates nothing; a child holds 200 MB: a parent-only sampler would miss it.
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(200 * MB)], stdout=subprocess.PIPE, text=True
    )
    with HostMemorySampler(interval_s=0.02) as with_children:
        child.communicate(timeout=60)
    assert with_children.peak_rss_bytes - psutil.Process().memory_info().rss > 190 * MB
    assert max(s.processes for s in with_children.samples) >= 2


def test_run_measured_reports_the_child_peak_and_its_result():
    run = run_measured([sys.executable, "-c", CHILD, str(250 * MB)], interval_s=0.02, timeout_s=60)
    assert run.result["size"] == 250 * MB
    # The child's own kernel high-water mark, the sampled peak and the high-water sum agree.
    assert run.peak_rss_bytes > 250 * MB
    assert run.peak_hwm_bytes >= run.result["self_peak"] > 250 * MB
    assert run.peak_rss_bytes <= run.peak_hwm_bytes
    assert run.wall_s > 0.6


def test_run_measured_failure_carries_stderr():
    with pytest.raises(MeasuredRunError, match="boom"):
        run_measured([sys.executable, "-c", "raise SystemExit('boom')"], timeout_s=30)
    with pytest.raises(MeasuredRunError, match="JSON result"):
        run_measured([sys.executable, "-c", "print('not json')"], timeout_s=30)


def test_self_peak_is_at_least_current_rss():
    import psutil

    assert self_peak_rss_bytes() >= psutil.Process().memory_info().rss * 0.99
