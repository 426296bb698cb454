"""What each notebook runs on the neuron target and in an endpoint run: never a cpu measurement it
depends on.

The runner skips the cells tagged ``cpu-measurement`` on the neuron target and when ``-p endpoint``
is set (``gemma_nb.tools.run.execute_one``); these checks read the notebooks' source, so a run that
would stop on a name only a skipped cell defines (or, on neuron, on the XLA check, which needs
``.venv-xla``) fails here, on any machine.
"""

import ast
import builtins
import json

import pytest

from gemma_nb.paths import NOTEBOOKS_DIR
from gemma_nb.targets import CPU_MEASUREMENT_TAG

NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))


def _code_cells(path):
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            yield "".join(cell["source"]), CPU_MEASUREMENT_TAG in cell["metadata"].get("tags", [])


class _On(ast.NodeTransformer):
    """Keeps what runs on ``target``: the ``else`` of an ``if target == "<another target>":``."""

    def __init__(self, target: str):
        self.target = target

    def visit_If(self, node):
        test = node.test
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "target"
            and isinstance(test.ops[0], ast.Eq)
            and getattr(test.comparators[0], "value", self.target) != self.target
        ):
            return [self.visit(child) for child in node.orelse]
        return self.generic_visit(node)


def _names(source: str, context, target: str) -> set[str]:
    tree = ast.parse(
        "\n".join(line for line in source.splitlines() if not line.startswith(("%", "!")))
    )
    tree = ast.fix_missing_locations(_On(target).visit(tree))
    found = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, context)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and context is ast.Store:
            found |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.arg) and context is ast.Store:  # lambda and function arguments
            found.add(node.arg)
        elif (
            isinstance(node, (ast.FunctionDef, ast.ExceptHandler))
            and context is ast.Store
            and node.name
        ):
            found.add(node.name)
    return found


def _parameters(path) -> set[str]:
    cell = json.loads(path.read_text())["cells"][1]
    return {node.targets[0].id for node in ast.parse("".join(cell["source"])).body}


# every notebook on neuron; on cpu, the notebook that takes an endpoint, with one set
RUNS = [(p, "neuron") for p in NOTEBOOKS] + [
    (p, "cpu") for p in NOTEBOOKS if "endpoint" in _parameters(p)
]


@pytest.mark.parametrize("path, target", RUNS, ids=lambda v: getattr(v, "stem", v))
def test_a_run_that_skips_the_cpu_measurements_never_reads_what_only_they_define(path, target):
    defined = set(dir(builtins)) | {"display", "target"}
    for source, skipped in _code_cells(path):
        if skipped:
            continue
        missing = _names(source, ast.Load, target) - defined - _names(source, ast.Store, target)
        assert not missing, (
            f"{path.stem}: a cell run on the {target} target reads {sorted(missing)}, which only "
            f"cells tagged {CPU_MEASUREMENT_TAG!r} define:\n{source[:300]}"
        )
        defined |= _names(source, ast.Store, target)


def test_the_xla_check_and_the_cpu_measurements_are_skipped_on_the_neuron_target():
    """Notebook 04's lowering check runs in .venv-xla, which an inf2 does not have."""
    for path in NOTEBOOKS:
        for source, skipped in _code_cells(path):
            if (
                "run_in_xla_env" in source
                or "tp_emulation(" in source
                or "measure_deploy(" in source
            ):
                assert skipped, f"{path.stem}: {source[:80]!r} would run on the neuron target"
            if 'if target == "neuron"' in source:
                assert not skipped, f"{path.stem}: a neuron cell is tagged {CPU_MEASUREMENT_TAG}"


def test_the_neuron_notebooks_take_every_build():
    params = {}
    for path in NOTEBOOKS:
        cell = json.loads(path.read_text())["cells"][1]
        assert "parameters" in cell["metadata"]["tags"]
        for node in ast.parse("".join(cell["source"])).body:
            params[(path.stem[:2], node.targets[0].id)] = ast.literal_eval(node.value)
    assert params[("04", "decode_experts")] == ["dense", "sparse"]
    assert params[("05", "neuron_artifacts")] == [] and params[("07", "neuron_artifacts")] == []
    assert ("07", "neuron_second_artifact") not in params and (
        "05",
        "neuron_artifact_dir",
    ) not in params
