"""The package imports one way: no cycles among its modules, and any module can be imported first.

The package's own imports sit at the top of each module (local imports only for the optional
Neuron SDK and the few exceptions their comments name), so a cycle would show at import time. Two
checks: the graph of module-level ``gemma_nb`` imports, read from the source, has no cycle; and
fresh interpreters import every module in several random orders.
"""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import random
import subprocess
import sys
from pathlib import Path

import gemma_nb

PACKAGE_DIR = Path(gemma_nb.__file__).parent


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(gemma_nb.__path__, "gemma_nb."))


def _module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    """The gemma_nb modules ``path`` imports at module level (``from gemma_nb import x`` names module x)."""
    modules = set(_modules()) | {"gemma_nb"}
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("gemma_nb")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gemma_nb"):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names} & modules
    return found


def test_module_level_imports_have_no_cycle():
    graph = {_module_of(p): _top_level_imports(p) - {_module_of(p)} for p in PACKAGE_DIR.rglob("*.py")}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join(path[path.index(module):] + [module])
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_every_module_imports_in_a_fresh_interpreter_in_random_orders():
    modules = _modules()
    assert {"gemma_nb.export", "gemma_nb.experiments.quantization", "gemma_nb.story", "gemma_nb.neuron.build"} <= set(modules)
    script = ("import importlib, json, sys\n"
              "for name in json.loads(sys.argv[1]):\n"
              "    importlib.import_module(name)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for seed in range(4):
        order = modules[:]
        random.Random(seed).shuffle(order)
        done = subprocess.run([sys.executable, "-c", script, json.dumps(order)], capture_output=True, text=True,
                              env=env, timeout=300)
        assert done.returncode == 0, f"order (seed {seed}) starting {order[:5]}:\n{done.stderr[-3000:]}"


def test_the_neuron_package_never_imports_the_rehearsal():
    """gemma_nb.rehearsal imports gemma_nb.neuron to prove it; the other way round would ship the
    emulation into the box's code path."""
    for path in (PACKAGE_DIR / "neuron").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any(name.startswith("gemma_nb.rehearsal") for name in imported), path.name
