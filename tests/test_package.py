"""The package's shape: sizes, module heads, imports that run one way, no cycles."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gemma_nb

PACKAGE = Path(gemma_nb.__file__).parent
REPO = PACKAGE.parent
# Counted on the code as `ruff format` writes it (100 columns; test_the_code_is_formatted).
MAX_TOTAL_LINES, MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_HEAD_LINES = 17_360, 800, 80, 15
LAZY_OK = ("torch_neuronx", "neuronx_distributed", "torch_xla")  # the optional SDKs
PRODUCTS = ("gemma_nb.serving", "gemma_nb.tools", "gemma_nb.neuron", "gemma_nb.rehearsal")
ENTRY_POINT = "gemma_nb.__main__"  # the CLI: it dispatches to the products
# importable as torch_neuronx / neuronx_distributed
EMULATED_SDK = PACKAGE / "rehearsal" / "sdk_path"


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[ast.stmt, str, bool]]:
    """(node, imported module, at module level) for every import in ``path``; ``from a import b``
    names ``a.b`` where that is a module of the package."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    known = {module_name(p) for p in sources()}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node, node.module, id(node) in top))
            found += [
                (node, f"{node.module}.{a.name}", id(node) in top)
                for a in node.names
                if f"{node.module}.{a.name}" in known
            ]
    return found


def graph() -> dict[str, set[str]]:
    known = {module_name(p) for p in sources()}
    return {
        module_name(p): {m for _, m, _ in imports(p) if m in known} - {module_name(p)}
        for p in sources()
        if EMULATED_SDK not in p.parents
    }


def test_the_code_is_formatted():
    """Physical lines are formatted lines only if nothing is packed past the formatter."""
    ruff = Path(sys.executable).with_name("ruff")
    done = subprocess.run(
        [ruff, "format", "--check", "gemma_nb", "tests", "notebooks"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_package_is_anchor_sized():
    total = sum(len(p.read_text().splitlines()) for p in sources())
    assert total <= MAX_TOTAL_LINES, f"gemma_nb has {total} lines; the limit is {MAX_TOTAL_LINES}"


def test_the_server_stays_small():
    lines = sum(len(p.read_text().splitlines()) for p in (PACKAGE / "serving").rglob("*.py"))
    assert lines <= 2_000, f"gemma_nb/serving has {lines} lines; the limit is 2,000"


def test_no_module_over_the_limit():
    big = {
        str(p.relative_to(REPO)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_no_function_over_the_limit():
    long = [
        f"{p.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} "
        "lines)"
        for p in sources()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "functions over the limit:\n" + "\n".join(long)


def test_module_heads_are_short():
    """A module's head (its docstring) says what the module is for in a few lines."""
    long = {}
    for p in sources():
        body = ast.parse(p.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            if (n := body[0].end_lineno - body[0].lineno + 1) > MAX_HEAD_LINES:
                long[str(p.relative_to(REPO))] = n
    assert not long, f"module heads over {MAX_HEAD_LINES} lines: {long}"


def test_no_history_notes_in_code_or_tests():
    note = re.compile(r"\bissues? #?\d+|\(was [a-z_]+\)|used to be", re.I)
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for p in [*sources(), *(REPO / "tests").rglob("*.py")]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if note.search(line) and p.name != "test_package.py"
    ]
    assert not hits, f"history notes: {hits}"


def test_only_the_optional_sdks_are_imported_inside_functions():
    lazy = [
        f"{p.relative_to(REPO)}:{node.lineno} {name}"
        for p in sources()
        if EMULATED_SDK not in p.parents
        for node, name, at_top in imports(p)
        if not at_top and not name.startswith(LAZY_OK)
    ]
    assert not lazy, "imports inside functions (move them to the top):\n" + "\n".join(
        sorted(set(lazy))
    )


def test_only_the_command_line_and_the_sdk_probe_import_modules_by_name():
    """The one exception to imports at the top: ``gemma_nb.cli`` imports a command's module when
    that command runs (``--help`` loads no torch: tests/test_cli_input.py), and ``neuron.sdk``
    probes the optional SDKs."""
    by_name = {
        module_name(p)
        for p in sources()
        if EMULATED_SDK not in p.parents
        for node in ast.walk(ast.parse(p.read_text()))
        if (isinstance(node, ast.Attribute) and node.attr == "import_module")
        or (isinstance(node, ast.Name) and node.id == "__import__")
    }
    assert by_name == {"gemma_nb.cli", "gemma_nb.neuron.sdk"}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One loop in the import graph ``edges`` (its nodes in order, the first again at the end), or
    []."""
    state = {}

    def visit(node: str, path: list[str]) -> list[str]:
        if state.get(node) == "open":
            return path[path.index(node) :] + [node]
        if state.get(node) == "done":
            return []
        state[node] = "open"
        for target in sorted(edges.get(node, ())):
            if found := visit(target, path + [node]):
                return found
        state[node] = "done"
        return []

    for node in sorted(edges):
        if found := visit(node, []):
            return found
    return []


def test_imports_have_no_cycle():
    found = cycle(graph())
    assert not found, "import cycle: " + " -> ".join(found)


def room(module: str) -> str:
    """A module's folder-level room: ``gemma_nb.neuron`` for anything under it, a top-level module
    itself."""
    return ".".join(module.split(".")[:2])


def test_the_library_imports_no_product():
    """The library (the top of gemma_nb and gemma_nb.tiny) imports no product and no experiment,
    at the top or inside a function: the port checks its SDK, the library never reaches into it."""
    outside = (*PRODUCTS, "gemma_nb.experiments")
    wrong = {
        m: sorted(t for t in targets if t.startswith(outside))
        for m, targets in graph().items()
        if not m.startswith(outside) and m != ENTRY_POINT
    }
    wrong = {m: t for m, t in wrong.items() if t}
    assert not wrong, wrong


def test_folders_import_one_way():
    """No loop between rooms (a subpackage, or a top-level module): e.g. gemma_nb.tiny's trainer
    importing evaluate while evaluate imports the tiny corpus."""
    rooms: dict[str, set[str]] = {}
    for module, targets in graph().items():
        rooms.setdefault(room(module), set()).update(
            room(t) for t in targets if room(t) != room(module)
        )
    found = cycle(rooms)
    assert not found, "a loop between folders: " + " -> ".join(found)


def test_products_do_not_import_notebook_experiments():
    wrong = {
        m: sorted(t for t in targets if t.startswith("gemma_nb.experiments"))
        for m, targets in graph().items()
        if m.startswith(PRODUCTS)
    }
    wrong = {m: t for m, t in wrong.items() if t}
    assert not wrong, wrong


def test_the_port_never_imports_its_rehearsal():
    """gemma_nb.rehearsal imports gemma_nb.neuron to prove it; never the other way round."""
    wrong = {
        m: t
        for m, t in graph().items()
        if m.startswith("gemma_nb.neuron") and any(x.startswith("gemma_nb.rehearsal") for x in t)
    }
    assert not wrong, wrong


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(graph())
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    done = subprocess.run(
        [sys.executable, "-c", script, *reversed(names)],
        capture_output=True,
        text=True,
        env={
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
        },
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


PHRASE = re.compile(r"[A-Za-z]+(?: [A-Za-z]+){2,}")  # three words in a row: a sentence, not a value


def checked_strings(node: ast.AST, in_assert: bool = False):
    """The strings a test checks its results against: ``match=`` patterns, and the literals in its
    asserts' conditions outside a call's arguments (those are inputs, such as a prompt)."""
    if isinstance(node, ast.keyword) and node.arg == "match":
        yield from (
            n.value
            for n in ast.walk(node.value)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        )
        return
    if in_assert and isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    for child in ast.iter_child_nodes(node):
        if isinstance(node, ast.Assert) and child is node.msg:
            continue
        inputs = in_assert and isinstance(node, ast.Call) and child is not node.func
        yield from checked_strings(
            child, (in_assert or isinstance(node, ast.Assert)) and not inputs
        )


def expects_assertion_error(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call)
        and getattr(n.func, "attr", None) == "raises"
        and n.args
        and getattr(n.args[0], "id", None) == "AssertionError"
        for n in ast.walk(node)
    )


def test_tests_pin_values_not_sentences():
    """A message check names the value and the fix; an internal assert is no contract (the suite
    passes under python -O)."""
    tests = [
        (f"{path.name}::{node.name}", node)
        for path in sorted((REPO / "tests").rglob("test_*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name.startswith("test_")
    ]
    pinning = [name for name, node in tests if any(map(PHRASE.search, checked_strings(node)))]
    assert len(pinning) <= len(tests) // 10, f"{len(pinning)} of {len(tests)} tests pin a phrase"
    expecting = [name for name, node in tests if expects_assertion_error(node)]
    assert not expecting, f"tests expecting AssertionError: {expecting}"


def test_no_two_modules_share_a_file_name():
    """A name says its subject once: the port's module is not the library's namesake (the emulated
    SDK mirrors the SDK's own paths, and dunder files are Python's)."""
    names = Counter(
        p.name for p in sources() if EMULATED_SDK not in p.parents and not p.name.startswith("__")
    )
    assert not [name for name, count in names.items() if count > 1]
