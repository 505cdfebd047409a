# Every target runs in one virtual environment: the active one ($VIRTUAL_ENV) when a
# shell has one, else .venv in this clone, created on first use (Debian's system Python
# refuses pip installs: PEP 668). The install stamp lives inside that environment, so
# another environment gets its own install instead of a stamp saying it has one.
VENV ?= $(or $(VIRTUAL_ENV),.venv)
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.kvrs-installed

.PHONY: install protos test lint typecheck check bench demo k8s-check

$(PYTHON):
	python3 -m venv $(VENV)

# torch is pinned to 2.13.0, the CPU build; pip never pulls a CUDA torch for it here.
# xds-protos ships its own, older copy of the OpenTelemetry protos over the files of
# opentelemetry-proto; reinstalling the latter restores what the OTLP exporter imports.
$(STAMP): pyproject.toml | $(PYTHON)
	$(PYTHON) -m pip install -q -e '.[dev]'
	$(PYTHON) -m pip install -q --force-reinstall --no-deps \
	  "opentelemetry-proto==$$($(PYTHON) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	@touch $(STAMP)

install: $(STAMP)

# Regenerate kvrs/v1 from protos/ (checked in; CI fails on a diff).
protos: $(STAMP)
	$(PYTHON) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/kvrs/v1/*.proto

test: $(STAMP)
	$(PYTHON) -m pytest

lint: $(STAMP)
	$(PYTHON) -m ruff check kvrs services libkvxfer tests bench
	$(PYTHON) -m ruff format --check kvrs services libkvxfer tests bench

# mypy over kvrs, libkvxfer and services (settings in pyproject.toml; kvrs/v1 left out).
typecheck: $(STAMP)
	$(PYTHON) -m mypy

# What to run before a change lands: lint, format, types and the fast tests.
check: lint typecheck
	$(PYTHON) -m pytest -m "not slow"

# deploy/k8s rendered offline and validated against the Kubernetes schemas.
k8s-check: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash deploy/k8s/validate.sh

# Starts a local cluster, kills a decode worker mid-stream, prints the recovery decisions.
demo: $(STAMP)
	$(PYTHON) -m kvrs demo

bench: $(STAMP)
	$(PYTHON) -m bench.core_decisions
	$(PYTHON) -m bench.control_plane
