"""``python -m gemma_nb run --target cpu``: the notebooks in story order with papermill, into a
staging folder swapped in over ``outputs/<target>/`` only when every notebook succeeded (README:
"Running notebooks")."""

import ast
import contextlib
import difflib
import json
import os
import platform
import shutil
import signal
import sys
import time
from collections import namedtuple
from pathlib import Path
from unittest import mock

import nbformat
import papermill
import psutil
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from gemma_nb.metrics import target_cells, write_json_atomic
from gemma_nb.neuron.sdk import check_target_with_sdk
from gemma_nb.paths import ARTIFACTS, NOTEBOOKS_DIR, OUTPUT_DIR_ENV, OUTPUTS_DIR, display_path
from gemma_nb.story import get_claim
from gemma_nb.targets import CPU_MEASUREMENT_TAG, REFERENCE_KERNELS

KERNEL_NAME = "python3"


class RunError(RuntimeError):
    """A notebook failed: the message names the notebook, the cell and the error. (Bad input is a
    ValueError.)"""


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: the run stops and the previous outputs stay as they were."""


NotebookResult = namedtuple("NotebookResult", "name seconds")


def discover_notebooks(notebooks_dir: Path = NOTEBOOKS_DIR) -> list[Path]:
    found = sorted(notebooks_dir.glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise RunError(f"no notebooks named NN_*.ipynb in {display_path(notebooks_dir)}")
    return found


def select_notebooks(notebooks: list[Path], only: str | None) -> list[Path]:
    """Filter by number prefixes ("01,03") or full stems; unknown selectors are an error."""
    if only is None:
        return notebooks
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    if not wanted:
        raise ValueError(
            f"--only {only!r} names no notebook; give numbers such as 01,03, or leave --only out "
            "to run all"
        )
    chosen = []
    for selector in wanted:
        matches = [
            nb
            for nb in notebooks
            if nb.stem == selector or nb.stem.split("_", 1)[0] == selector.zfill(2)
        ]
        if not matches:
            raise ValueError(
                f"--only {selector!r} matches no notebook; available: "
                f"{', '.join(nb.stem for nb in notebooks)}"
            )
        chosen += [nb for nb in matches if nb not in chosen]
    return sorted(chosen)


def notebook_parameters(notebook: Path) -> list[str]:
    """The names the notebook's ``parameters`` cell assigns, in order (``target`` included)."""
    cells = nbformat.read(notebook, as_version=4).cells
    cells = [
        c for c in cells if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])
    ]
    nodes = [node for cell in cells for node in ast.parse(cell.source).body]
    targets = [
        t
        for node in nodes
        for t in (node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)])
    ]
    return list(dict.fromkeys(t.id for t in targets if isinstance(t, ast.Name)))


def check_parameters(parameters: dict, notebooks: list[Path]) -> None:
    """Refuse a parameter that none of ``notebooks`` declares, naming the closest known one."""
    known = sorted({name for nb in notebooks for name in notebook_parameters(nb)} - {"target"})
    for name in (name for name in parameters if name not in known):
        hint = "".join(
            f" (did you mean {close!r}?)" for close in difflib.get_close_matches(name, known, n=1)
        )
        raise ValueError(
            f"-p {name}: no selected notebook has a parameter {name!r}{hint}; they take: "
            f"{', '.join(known) or 'none'}"
        )


def resolve_path_parameters(parameters: dict) -> dict:
    """The caller's relative paths made absolute (papermill runs in ``notebooks/``): a string that
    names a path under the working folder, or whose parameter's name ends in _dir, _path or _file;
    hub ids stay as they are."""
    cwd, resolved = Path.cwd(), {}
    for name, value in parameters.items():
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            candidate = cwd / Path(value).expanduser()
            if candidate.exists() or name.endswith(("_dir", "_path", "_file")):
                value = str(candidate.resolve())
        resolved[name] = value
    return resolved


def _raise_terminated(signum, _frame):
    raise Terminated(f"stopped by signal {signal.Signals(signum).name}")


def kernelspec_metadata(name: str = KERNEL_NAME) -> dict[str, str]:
    """The ``kernelspec`` notebook metadata of the installed kernel ``name``, as JupyterLab writes
    it."""
    spec = KernelSpecManager().get_kernel_spec(name)
    return {"display_name": spec.display_name, "language": spec.language, "name": name}


class QuietShutdownKernelManager(AsyncKernelManager):
    """No SIGINT before the shutdown request (ipykernel would log a KeyboardInterrupt after a good
    run)."""

    async def _async_interrupt_kernel(self) -> None:
        if not self.shutting_down:
            await super()._async_interrupt_kernel()


def execute_one(
    notebook: Path, staging: Path, target: str, parameters: dict, progress: bool
) -> None:
    """Run one notebook with papermill, skipping the ``CPU_MEASUREMENT_TAG`` cells on the neuron
    target and where ``parameters`` name an ``endpoint`` (that run times the server, not this
    machine)."""
    skip = target == "neuron" or bool(parameters.get("endpoint"))
    papermill.execute_notebook(
        str(notebook),
        str(staging / notebook.name),
        parameters={"target": target, **parameters},
        cwd=str(notebook.parent),
        kernel_name=KERNEL_NAME,
        kernel_manager_class=QuietShutdownKernelManager,
        log_output=False,
        progress_bar={"desc": f"{notebook.stem:<28}", "unit": "cell", "leave": True}
        if progress
        else False,
        **({"skip_cells_with_tag": CPU_MEASUREMENT_TAG} if skip else {}),
    )


def _format_value(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


# The repo's answer, atop REPORT.md and the README, with the figures of notebooks 01 and 07.
ANSWER = (
    "Gemma-4-26B-A4B fits an inf2.xlarge at TP=2 with int8 experts, an int8 dense MLP and an int8 "
    "lm_head split over the two NeuronCores: {m01[final_residency_gb_per_rank]:.2f} GB of weights "
    "and KV cache per core, of {m01[hbm_per_core_gb]:.2f} GB. The port's "
    "{m07[inf2_measured_tok_s]:g} tokens/s is not what those bytes allow: even reading all 128 "
    "experts for every token, as its DenseExperts op does, the bandwidth roofline is "
    "{m07[inf2_dense_tok_s]:.1f} tokens/s. Reading only the 8 routed experts raises it to "
    "{m07[inf2_sparse_tok_s]:.1f} tokens/s and cuts the cost of a million tokens from USD "
    "{m07[inf2_dense_usd_per_m_tokens]:.2f} to USD {m07[inf2_sparse_usd_per_m_tokens]:.2f}."
)
ANSWER_FROM = ("01_memory_arithmetic", "07_decode_benchmark")


REPORT_TABLE = "| figure | value | unit | claimed | target | met? |\n|---|---:|---|---:|---|---|"


def _report_row(row: dict) -> str:
    claimed = get_claim(row["claim"]).written() if "claim" in row else ""
    cells = [row["name"], _format_value(row["value"]), row.get("unit", ""), claimed]
    return "| " + " | ".join([*cells, *target_cells(row)]) + " |"


def write_report(staging: Path, summary: dict) -> Path:
    """``REPORT.md``: the repo's answer, then each notebook's headline figures (beside the story's
    claims, and the targets it set) and its plots."""
    notebooks = summary["notebooks"]
    lines = [
        f"# gemma-nb reference run: target `{summary['target']}`",
        "",
        "Generated by `python -m gemma_nb run`; every figure below was computed by the notebooks "
        "in",
        "this folder. *Claimed* is the figure an outside source published, as it wrote it "
        "(`gemma_nb/story.py`); a *target* is one the notebook set itself.",
        "",
    ]
    with contextlib.suppress(KeyError):  # a run without 01 and 07 has no answer to give
        m01, m07 = (notebooks[key]["metrics"] for key in ANSWER_FROM)
        lines[1:1] = ["", ANSWER.format(m01=m01, m07=m07)]
    figures = sorted((staging / "figures").glob("*.png"))
    # One section per executed notebook, with a table per metrics file it wrote (07 writes two).
    for notebook in sorted(staging.glob("*.ipynb")):
        name, prefix = notebook.stem, notebook.stem[:2] + "_"
        lines += [f"## {name}", "", f"Notebook: [{name}.ipynb]({name}.ipynb)", ""]
        for key in sorted(
            (k for k in notebooks if k.startswith(prefix)), key=lambda k: (k != name, k)
        ):
            rows = notebooks[key].get("headline", [])
            if key != name:
                lines += [f"Also written: `metrics/{key}.json`", ""]
            if rows:
                lines += [REPORT_TABLE, *map(_report_row, rows), ""]
        for fig in (f for f in figures if f.stem.startswith(prefix)):
            lines += [f"![{fig.stem}](figures/{fig.name})", ""]
    (path := staging / "REPORT.md").write_text("\n".join(lines))
    return path


def run(
    target: str = "cpu",
    only: str | None = None,
    output_dir: Path | str | None = None,
    parameters: dict | None = None,
    progress: bool = True,
    notebooks_dir: Path = NOTEBOOKS_DIR,
) -> list[NotebookResult]:
    """Execute the notebooks for ``target``; on success the outputs replace ``output_dir``."""
    check_target_with_sdk(target)
    selected = select_notebooks(discover_notebooks(Path(notebooks_dir)), only)
    parameters = resolve_path_parameters(parameters or {})
    check_parameters(parameters, selected)
    final = (Path(output_dir) if output_dir else OUTPUTS_DIR / target).resolve()
    if file := next((p for p in (final, *final.parents) if p.exists() and not p.is_dir()), None):
        raise ValueError(
            f"--output-dir {output_dir}: {display_path(file)} is a file, not a folder; pass a "
            "folder (it need not exist yet)"
        )
    staging, failed = _staging_for(final, keep_previous=bool(only))
    # cpu pins, x86-64 only
    kernels = dict(REFERENCE_KERNELS) if platform.machine().lower() in ("x86_64", "amd64") else {}
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        # the kernels inherit it
        with mock.patch.dict(os.environ, {OUTPUT_DIR_ENV: str(staging), **kernels}):
            results = [
                _execute_step(
                    number, selected, staging, failed, final, target, parameters, progress
                )
                for number in range(1, len(selected) + 1)
            ]
        notebooks = {
            path.stem: json.loads(path.read_text())
            for path in sorted((staging / "metrics").glob("*.json"))
        }
        summary = {"target": target, "kernels": kernels, "notebooks": notebooks}
        write_json_atomic(staging / "summary.json", summary)  # every metrics/*.json in one file
        write_report(staging, summary)
        # swap in: final aside, staging in, the old copy gone; no Ctrl-C or SIGTERM between the
        # renames (they wait for the unblock), and a failed rename puts the old copy back
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            if final.exists():
                final.rename(old)
            staging.rename(final)
        finally:
            if old.exists() and not final.exists():
                old.rename(final)
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        # interrupted (Ctrl-C, SIGTERM) before the swap: keep the old outputs intact
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    return results


def _staging_for(final: Path, keep_previous: bool) -> tuple[Path, Path]:
    """A fresh staging folder beside ``final`` and where a failed run goes; with ``keep_previous``,
    a copy of ``final`` whose ``artifacts/`` are hard-linked (their writers start afresh,
    ``paths.fresh_dir``, never write through)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for folder in final.parent.glob(f".{final.name}.tmp-*"):  # left behind by a run that was killed
        pid = folder.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            print(
                f"removed {display_path(folder)}, left behind by a run that was killed",
                file=sys.stderr,
            )
    staging = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    failed = final.with_name(f".{final.name}.failed")
    shutil.rmtree(staging, ignore_errors=True)

    def link_or_copy(source, target):
        if Path(source).is_relative_to(final / ARTIFACTS):
            with contextlib.suppress(OSError):
                os.link(source, target)
                return target
        return shutil.copy2(source, target)

    if keep_previous and final.exists():
        shutil.copytree(final, staging, copy_function=link_or_copy)
    staging.mkdir(parents=True, exist_ok=True)
    return staging, failed


def _execute_step(
    number: int,
    selected: list[Path],
    staging: Path,
    failed: Path,
    final: Path,
    target: str,
    parameters: dict,
    progress: bool,
) -> NotebookResult:
    """Execute notebook ``number`` (1-based) of ``selected``; on an error, staging moves to
    ``failed`` and RunError says where."""
    notebook = selected[number - 1]
    print(
        f"[{number}/{len(selected)}] {notebook.stem} (target {target})", file=sys.stderr, flush=True
    )
    start = time.perf_counter()
    try:
        execute_one(notebook, staging, target, parameters, progress)
    except Exception as error:  # papermill raises PapermillExecutionError with cell details
        shutil.rmtree(failed, ignore_errors=True)
        staging.rename(failed)
        cell, index = getattr(error, "exec_count", None), getattr(error, "cell_index", None)
        where = (f"cell {index}" if index is not None else "a cell") + (
            f" (execution count {cell})" if cell is not None else ""
        )
        raise RunError(
            f"notebook {notebook.stem} failed in {where}: "
            f"{getattr(error, 'ename', type(error).__name__)}: "
            f"{getattr(error, 'evalue', error)}\nThe executed notebook with the error is in "
            f"{display_path(failed)}/{notebook.name}; {display_path(final)} was left as it was."
        ) from error
    # Drop the machine's paths papermill records, name its injected cell (papermill draws a random
    # id), record the installed kernel's spec: two runs then differ only in what they measured.
    nb = nbformat.read(staging / notebook.name, as_version=4)
    for cell in (c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])):
        cell.id = "injected-parameters"
    meta = nb.metadata.get("papermill", {})
    meta.update(
        {key: Path(meta[key]).name for key in ("input_path", "output_path") if meta.get(key)}
    )
    nb.metadata["kernelspec"] = kernelspec_metadata()
    nbformat.write(nb, staging / notebook.name)
    result = NotebookResult(notebook.stem, time.perf_counter() - start)
    print(f"    done in {result.seconds:.1f} s", file=sys.stderr, flush=True)
    return result


def parse_parameter(pair: list[str]) -> tuple[str, object]:
    """``-p NAME VALUE``: a Python literal, else the text itself (a model id)."""
    name, raw = pair
    if name in ("target", "hf_token", "HF_TOKEN"):
        raise ValueError(
            f"-p {name} is not a notebook parameter: use --target, and HF_TOKEN from the "
            "environment"
        )
    try:
        return name, ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return name, raw


def main(args) -> int:
    """Exit 0 when every notebook ran, 1 when one failed, 2 for bad input, 130 or 143 when
    stopped."""
    try:
        results = run(
            target=args.target,
            only=args.only,
            output_dir=args.output_dir,
            parameters=dict(parse_parameter(pair) for pair in args.parameter),
            progress=not args.no_progress,
        )
    except (ValueError, RunError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1  # bad input, or a notebook that failed
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM (Terminated)
        print(
            f"interrupted ({str(interrupt) or 'Ctrl-C'}); the previous outputs were left as they "
            "were",
            file=sys.stderr,
        )
        return 143 if isinstance(interrupt, Terminated) else 130
    print(
        f"{len(results)} notebook(s) for target {args.target} in "
        f"{sum(r.seconds for r in results):.0f} s",
        file=sys.stderr,
    )
    return 0
