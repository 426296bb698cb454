# Two commands on a fresh machine (Python 3.11 + git): `make run`, `make test`.
# Each creates .venv if it is missing and installs the package with its pinned dependencies.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TARGET ?= cpu
ONLY ?=
# The cpu environment takes the CPU build of torch; other targets bring their own torch.
EXTRAS ?= cpu,dev

.PHONY: install run test test-unit test-notebooks lab clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@touch $(STAMP)

## Execute every notebook for TARGET (default cpu) into outputs/$(TARGET)/.
run: $(STAMP)
	$(PY) -m gemma_nb run --target $(TARGET) $(if $(ONLY),--only $(ONLY),)

## Unit tests, then nbval re-executes the committed reference run and compares its outputs.
test: test-unit test-notebooks

test-unit: $(STAMP)
	$(PY) -m pytest tests/ -q

# nbval writes the metrics/figures of its re-run into a scratch folder, never over outputs/cpu.
test-notebooks: $(STAMP)
	@scratch=$$(mktemp -d) && \
	GEMMA_NB_OUTPUT_DIR=$$scratch $(PY) -m pytest --nbval outputs/cpu/ \
		--nbval-sanitize-with tests/nbval_sanitize.cfg -q -p no:cacheprovider; \
	status=$$?; rm -rf $$scratch; exit $$status

## JupyterLab on notebooks/ with the package importable (as root, e.g. in a container: --allow-root).
## Notebooks run here write to outputs/interactive/, never over the reference run.
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root,)

clean-venv:
	rm -rf $(VENV)
