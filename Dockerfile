# CPU image (the CUDA wheels in uv.lock also run on a GPU host with the NVIDIA runtime).
#   docker build -t attnlab . && docker run --rm -v "$PWD/logs:/app/logs" attnlab
FROM python:3.11-slim
RUN pip install --no-cache-dir uv
WORKDIR /app
COPY pyproject.toml uv.lock README.md .python-version ./
RUN uv sync --frozen --no-install-project
COPY src ./src
COPY conf ./conf
COPY tests ./tests
COPY benchmarks ./benchmarks
RUN uv sync --frozen
ENV WANDB_MODE=offline
ENTRYPOINT ["uv", "run", "--frozen"]
CMD ["attnlab-train"]
