# syntax=docker/dockerfile:1
# attnlab in a container, on a CPU or a GPU, installed from the committed uv.lock as the README
# installs it. PyTorch's wheels bring their own CUDA libraries, so the base needs none: on a GPU
# host the NVIDIA container toolkit adds the driver (`docker run --gpus all ...`).
#   docker build -t attnlab .
#   docker run --rm -v "$PWD/logs:/app/logs" attnlab          # the README's main job
#   docker run --rm --gpus all -v "$PWD/logs:/app/logs" -v "$PWD/../shared/data:/data:ro" attnlab \
#     attnlab-train experiment=vit_fashion_mnist data.data_dir=/data/fashion_mnist trainer=gpu
# BASE may be any glibc Linux image (a local one where registries are out of reach:
# --build-arg BASE=localhost/debian:bookworm); Python comes from uv, pinned by .python-version.
ARG BASE=debian:bookworm-slim
FROM ghcr.io/astral-sh/uv:0.13.9 AS uv
FROM ${BASE}

COPY --from=uv /uv /usr/local/bin/uv
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 attnlab \
    && install -d -o attnlab -g attnlab /app /app/logs /opt/python
# bytecode compiled once at build; a copy from the cache mount (another filesystem); the
# interpreter installed by uv where the user can read it; the system's CA store (TLS proxies)
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    UV_NATIVE_TLS=1 \
    PATH=/app/.venv/bin:$PATH
USER 1000:1000
WORKDIR /app

# dependencies first (a layer that survives code changes), then the project; no dev tools
COPY --chown=attnlab:attnlab pyproject.toml uv.lock .python-version README.md ./
RUN --mount=type=cache,target=/home/attnlab/.cache/uv,uid=1000,gid=1000 \
    uv python install \
    && uv sync --frozen --no-dev --no-install-project
COPY --chown=attnlab:attnlab src ./src
COPY --chown=attnlab:attnlab conf ./conf
RUN --mount=type=cache,target=/home/attnlab/.cache/uv,uid=1000,gid=1000 \
    uv sync --frozen --no-dev

VOLUME ["/app/logs"]
CMD ["attnlab-train"]
