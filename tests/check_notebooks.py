"""`make test-notebooks`: nbval re-executes the reference run (outputs/cpu) under other cpu kernels.

Every kernel starts with ``gemma_nb.targets.CHECK_KERNELS``, a kernel set other than the one the
reference run was made with (``REFERENCE_KERNELS``), so an output that depends on the CPU's kernels
fails here, on any machine. One pytest process runs the notebooks named, in order, into a scratch
folder, never over outputs/cpu; the Makefile runs its jobs (``NBVAL_JOBS``) two at a time, a
notebook that reads what an earlier one wrote (05 reads 04's export) in that one's job, after it.
The kernels also see a made-up ``HF_TOKEN``: it must appear in no output (nbval compares them) and
no file the notebooks write. And ``GEMMA_NB_TIMING=smoke``: nbval compares no timing, so every
timing loop runs once (``gemma_nb.bench``).

    python tests/check_notebooks.py            # every notebook, one process
    python tests/check_notebooks.py 04 05      # some
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "outputs" / "cpu"
EVERY = ("01", "02", "03", "04", "05", "06", "07")
FAKE_TOKEN = "hf_fakeTOKENforTESTSnotREAL0123456789"
sys.path.insert(0, str(REPO))

from gemma_nb.targets import CHECK_KERNELS  # noqa: E402


def notebooks(numbers) -> list[str]:
    found = []
    for number in numbers:
        matches = sorted(REFERENCE.glob(f"{number}_*.ipynb"))
        if not matches:
            raise SystemExit(
                f"no notebook {number}_*.ipynb in {REFERENCE.relative_to(REPO)}: run `make run` "
                "first"
            )
        found += [str(m.relative_to(REPO)) for m in matches]
    return found


def start(numbers, scratch: str) -> subprocess.Popen:
    env = {
        **os.environ,
        **CHECK_KERNELS,
        "GEMMA_NB_OUTPUT_DIR": scratch,
        "HF_TOKEN": FAKE_TOKEN,
        "HF_HUB_OFFLINE": "1",
        "GEMMA_NB_TIMING": "smoke",
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "--nbval",
        *notebooks(numbers),
        "-q",
        "-p",
        "no:cacheprovider",
        "--nbval-sanitize-with",
        "tests/nbval_sanitize.cfg",
    ]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def token_leaks(scratch: str, output: str) -> list[str]:
    """Where the made-up token shows up: the pytest output, or files under ``scratch``."""
    leaks = ["pytest output"] if FAKE_TOKEN in output else []
    return leaks + [
        str(p)
        for p in Path(scratch).rglob("*")
        if p.is_file() and FAKE_TOKEN.encode() in p.read_bytes()
    ]


def finish(group, process: subprocess.Popen, scratch: str, started: float) -> tuple[str, int]:
    output, _ = process.communicate()
    seconds = time.perf_counter() - started
    status, leaks = process.returncode, token_leaks(scratch, output)
    if leaks:
        status, output = status or 1, output + f"\nHF_TOKEN leaked into: {', '.join(leaks)}\n"
    return f"--- notebooks {' '.join(group)}: exit {status} after {seconds:.0f} s\n{output}", status


def main(argv: list[str]) -> int:
    numbers = tuple(argv) or EVERY
    kernels = " ".join(f"{k}={v}" for k, v in CHECK_KERNELS.items())
    print(f"nbval over {' '.join(numbers)}, with {kernels}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        text, status = finish(numbers, start(numbers, scratch), scratch, time.perf_counter())
    print(text, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
