# attnlab in a container, on a GPU or a CPU, installed the way the README installs it (uv and
# the committed uv.lock; PyTorch's CUDA wheels bring their own CUDA libraries, the host only
# needs the NVIDIA driver and container toolkit).
#   docker build -t attnlab .
#   docker run --rm --gpus all -v "$PWD/logs:/app/logs" -v "$PWD/../shared/data:/data:ro" attnlab \
#     attnlab-train experiment=vit_fashion_mnist data.data_dir=/data/fashion_mnist trainer=gpu
#   docker run --rm -v "$PWD/logs:/app/logs" attnlab          # CPU: the README's main job
# BASE may be any Debian or Ubuntu image with apt (a local one where registries are out of reach:
# --build-arg BASE=localhost/debian:bookworm).
ARG BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_NO_CACHE=1 \
    WANDB_MODE=offline
# apt versions unpinned: the same line serves Ubuntu and Debian bases, whose versions differ
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# the README's install: `pip install uv`, then `uv run` builds .venv from uv.lock
RUN python3 -m pip install --no-cache-dir --break-system-packages uv==0.13.9

WORKDIR /app
COPY pyproject.toml uv.lock .python-version README.md ./
RUN python3 -m uv sync --frozen --no-install-project
COPY src ./src
COPY conf ./conf
COPY tests ./tests
COPY benchmarks ./benchmarks
RUN python3 -m uv sync --frozen

VOLUME ["/app/logs"]
ENTRYPOINT ["python3", "-m", "uv", "run", "--frozen"]
CMD ["attnlab-train"]
