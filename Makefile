# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates the virtualenv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean chart-sync

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ddm up

# The end-to-end tests' node agent needs ip (iproute2), unshare, setpriv and mount (util-linux).
test: lint
	@command -v ip >/dev/null && command -v setpriv >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq iproute2 util-linux)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks
	PYTHONPATH=src $(BIN)/lint-imports

clean:
	rm -rf $(VENV) out

# The chart can only read files inside it: refresh its copies of the CRD and the example.
chart-sync:
	cp crds/ddmdeployments.ddm.dev.yaml charts/ddm-operator/crds/
	cp examples/digits.yaml charts/ddm-operator/examples/
