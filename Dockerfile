# One image runs every Baton process: `baton engine`, `baton router` and `baton operator`.
#   docker build -t baton:0.1.0 .
# CPU build by default. For NVIDIA GPUs build on a CUDA base image and give the matching torch:
#   docker build --build-arg BASE=<cuda-python-image> --build-arg TORCH_SPEC=torch .
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_SPEC=torch==2.13.0
# Extra pip options for torch alone, e.g. an index that serves the CPU-only wheels.
ARG TORCH_PIP_ARGS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BATON_CACHE_DIR=/tmp/baton-cache \
    HF_HOME=/tmp/hf

# A C compiler builds the CPU attention kernel on first use (engines on CPU nodes only).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first, pinned, so that installing the package cannot pull in another torch build.
RUN pip install ${TORCH_PIP_ARGS} "${TORCH_SPEC}"

WORKDIR /opt/baton
COPY pyproject.toml README.md ./
COPY baton ./baton
RUN pip install ".[tracing]" && baton --help > /dev/null

# Non-root; the operator's Deployment also sets runAsUser 10001 and a read-only root.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin baton
USER 10001
EXPOSE 8000 14579
ENTRYPOINT ["baton"]
CMD ["--help"]
