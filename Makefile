# Two commands on a fresh machine (Python 3.11 + git): `make run`, `make test`.
# Each creates .venv if it is missing and installs the package with its pinned dependencies, and
# .venv-xla: the Neuron SDK 2.31's torch + torch-xla (envs/xla/requirements.txt), where notebook 04
# and tests/xla lower the neuron graphs to XLA on the cpu.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TARGET ?= cpu
ONLY ?=
# The cpu environment takes the CPU build of torch; other targets bring their own torch.
EXTRAS ?= cpu,dev
XLA_VENV := .venv-xla
XLA_PY := $(XLA_VENV)/bin/python
XLA_STAMP := $(XLA_VENV)/.installed
# No pip cache: the wheels would stay on disk beside what they unpack to.
export PIP_NO_CACHE_DIR := 1

.PHONY: install git-filter xla envs run lint test test-unit test-xla test-notebooks lab clean-venv rehearse rehearse-env

install: $(STAMP) git-filter

## Saved outputs stay out of notebooks/ (.gitattributes names the filter for notebooks/*.ipynb only,
## never the reference run in outputs/): git strips them as it reads a notebook in, with the
## nbstripout of the checkout's own .venv, so one shared git config serves every worktree. Where a
## checkout has no .venv yet, git warns and reads the notebook as it is; tests/test_readers_view.py
## still refuses outputs in notebooks/.
git-filter:
	@git rev-parse --git-dir >/dev/null 2>&1 || exit 0; \
	git config filter.nbstripout.clean '$(PY) -m nbstripout --keep-id' && \
	git config filter.nbstripout.smudge cat

## Both environments (the xla one with the rehearsal's packages), installed side by side: installing
## is mostly unpacking wheels.
envs: git-filter
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(REHEARSE_STAMP)

## The xla environment: pinned torch 2.9.0 / torch-xla 2.9.0 / transformers, the package without its
## notebook dependencies (--no-deps; envs/xla/requirements.txt lists what the lowering imports).
xla: $(XLA_STAMP)

$(XLA_STAMP): envs/xla/requirements.txt envs/xla/cuda-libs.txt envs/xla/install.sh envs/uv.txt \
		pyproject.toml
	@test -x $(XLA_PY) || $(PYTHON) -m venv $(XLA_VENV)
	sh envs/xla/install.sh $(XLA_PY)
	@touch $(XLA_STAMP)

$(STAMP): pyproject.toml envs/cpu/install.sh envs/uv.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	sh envs/cpu/install.sh $(PY) $(EXTRAS)
	@touch $(STAMP)

## Execute every notebook for TARGET (default cpu) into outputs/$(TARGET)/.
run: envs
	$(PY) -m gemma_nb run --target $(TARGET) $(if $(ONLY),--only $(ONLY),)

## ruff format --check and ruff check (pyproject's [tool.ruff]) and the one-core jobs in two lanes,
## each job's output printed whole when it ends: .venv, ruff, nbval over 03-06-01 (it needs only
## .venv), over 04-05, the XLA lowering checks; .venv-xla, the rehearsal (its commands run one
## after another), nbval over 07-02. Then the unit tests, on both cores.
test: git-filter
	@$(MAKE) --no-print-directory -j2 --output-sync=target TEST_LANES=1 lint nbval-03-06-01 \
		rehearse nbval-04-05 nbval-07-02 test-xla
	@$(MAKE) --no-print-directory test-unit

# make -j starts any job whose prerequisites are done, in no set order: these hold the lanes above.
ifdef TEST_LANES
nbval-04-05: | nbval-03-06-01
test-xla: | nbval-04-05
nbval-07-02: | rehearse
endif

lint: $(STAMP)
	$(VENV)/bin/ruff format --check gemma_nb tests notebooks
	$(VENV)/bin/ruff check gemma_nb tests notebooks

# tests/xla is collected only where torch_xla imports (tests/conftest.py), i.e. in .venv-xla.
# Two workers, each test file on one of them (its module fixtures are built once), one torch thread
# each on the two cores (two threads each waited on each other: 272 s against 252 s); without the
# nbval and schemathesis plugins, which no unit test uses (~4 s of imports in each process).
test-unit: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests/ -q -n 2 --dist loadfile -p no:nbval -p no:schemathesis

test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_PY) -m pytest tests/xla -q -p no:cacheprovider

# nbval re-executes the reference run under other cpu kernels into scratch folders, never over
# outputs/cpu (tests/check_notebooks.py says how): a job per process (one core each), two at a time;
# 05 reads 04's export, so they share a job.
NBVAL_JOBS := 03-06-01 04-05 07-02
test-notebooks:
	@$(MAKE) --no-print-directory -j2 --output-sync=target $(addprefix nbval-,$(NBVAL_JOBS))

nbval-%: $(STAMP)
	$(PY) tests/check_notebooks.py $(subst -, ,$*)

nbval-04-05: $(XLA_STAMP)  # 04's lowering check runs in .venv-xla

## The rehearsal environment: .venv-xla (the SDK's torch 2.9.0 and torch-xla) plus the notebooks' packages, installed
## as the runbook installs them on the box (envs/neuron/install.sh: the environment's torch and numpy kept).
## The stamp holds the install's seconds (rehearsal.json reports them).
REHEARSE_STAMP := $(XLA_VENV)/.rehearsal-env
rehearse-env: $(REHEARSE_STAMP)

$(REHEARSE_STAMP): $(XLA_STAMP) envs/neuron/notebooks.txt envs/neuron/install.sh
	@start=$$(date +%s); PYTHON=$(XLA_PY) sh envs/neuron/install.sh && \
		echo $$(( $$(date +%s) - start )) > $(REHEARSE_STAMP)

## The runbook (docs/inf2.md) run in order against the emulated Neuron SDK, at the SDK's torch; writes
## outputs/neuron-rehearsal/rehearsal.json (gemma_nb/rehearsal/rehearse.py).
rehearse: $(REHEARSE_STAMP)
	$(XLA_PY) -m gemma_nb.rehearsal

## JupyterLab on notebooks/ with the package importable (as root, e.g. in a container: --allow-root).
## Notebooks run here write to outputs/interactive/, never over the reference run.
lab: $(STAMP) git-filter
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 $(if $(filter 0,$(shell id -u)),--allow-root,)

clean-venv:
	rm -rf $(VENV) $(XLA_VENV)
