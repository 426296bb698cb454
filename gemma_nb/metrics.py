"""Metrics JSON: what each notebook computed (``save_metrics``), with its headline figures for the
runner's report."""

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gemma_nb.paths import output_subdir
from gemma_nb.story import get_claim, with_unit


def headline(
    name: str,
    value: float | int | str,
    unit: str = "",
    claim: str | None = None,
    at_least: float | None = None,
    at_most: float | None = None,
) -> dict:
    """One key figure. ``claim`` is a key of ``gemma_nb.story.CLAIMS`` this value answers;
    ``at_least`` or ``at_most`` a target it is held to (``met``: whether it holds)."""
    answers = {} if claim is None else {"claim": claim, "claimed": get_claim(claim).value}
    if at_least is not None:
        answers.update(at_least=at_least, met=bool(value >= at_least))
    if at_most is not None:
        answers.update(at_most=at_most, met=bool(value <= at_most))
    return {"name": name, "value": value, "unit": unit, **answers}


def target_cells(row: Mapping[str, Any]) -> tuple[str, str]:
    """A headline row's target as a reader reads it ("at least 12x") and "met" or "missed"; blanks
    for a row without one."""
    for bound in ("at_least", "at_most"):
        if bound in row:
            target = with_unit(f"{bound.replace('_', ' ')} {row[bound]:g}", row["unit"])
            return target, "met" if row["met"] else "missed"
    return "", ""


def _jsonable(value: Any) -> Any:
    """Plain JSON types only: numpy/torch scalars become floats, NaN becomes None."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return value.as_posix()
    raise TypeError(
        f"metric value {value!r} of type {type(value).__name__} is not JSON-serialisable"
    )


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON via a temp file + rename, so an interrupted run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; metrics are for every reader, like any output file
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_metrics(
    target: str, notebook: str, metrics: Mapping[str, Any], headline: list[dict] | None = None
) -> Path:
    """Write ``metrics/<notebook>.json`` under the target's output folder; return its path."""
    payload = {
        "notebook": notebook,
        "target": target,
        "headline": headline or [],
        "metrics": dict(metrics),
    }
    path = output_subdir(target, "metrics") / f"{notebook}.json"
    write_json_atomic(path, _jsonable(payload))
    return path
