# One image runs every Baton process: `baton engine`, `baton router` and `baton operator`.
# Two targets from one file:
#   docker build --target cpu  -t baton:0.1.0 .        # CPU nodes (the default target is cpu)
#   docker build --target cuda -t baton:0.1.0-cuda .   # NVIDIA GPU nodes: CUDA torch and NIXL
# The operator runs pools that ask for nvidia.com/gpu on the -cuda image (its --default-gpu-image).
# Each target is built in a stage with the compilers and copied, as one virtual environment,
# into a runtime stage that has none (the CUDA one keeps gcc for Triton, see below).
ARG PYTHON_IMAGE=python:3.11-slim

# ---- build stages ------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/baton
ENV PATH=/opt/baton/bin:$PATH
WORKDIR /src

FROM build AS build-cpu
ARG TORCH_SPEC=torch==2.13.0
# Extra pip options for torch alone, e.g. an index that serves the CPU-only wheels.
ARG TORCH_PIP_ARGS=""
# torch first, pinned, so that installing the package cannot pull in another torch build.
RUN pip install ${TORCH_PIP_ARGS} "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY baton ./baton
RUN pip install ".[tracing]" \
    # The C attention kernel, one library per x86-64 level: the runtime stage has no compiler.
    && python -m baton.engine.ops.cpu_paged_attention --prebuild /opt/baton/kernels \
    && baton --help > /dev/null

FROM build AS build-cuda
# The default torch wheels for Linux x86-64 carry their CUDA libraries; the node's driver comes
# from the NVIDIA container runtime.
ARG TORCH_SPEC=torch==2.13.0
RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY baton ./baton
# NIXL for --kv-transport auto/nixl: KV blocks READ from GPU memory without a host copy.
RUN pip install ".[tracing,nixl]" \
    && python -c "import nixl_cu12._api" \
    && baton --help > /dev/null

# ---- runtime stages ----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/baton/bin:$PATH \
    BATON_CACHE_DIR=/tmp/baton-cache \
    HF_HOME=/tmp/hf
# tini is PID 1: it forwards signals to baton and reaps the EngineCore's and workers' orphans.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
# Non-root; the operator's Deployments also set runAsUser 10001 and a read-only root.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin baton
EXPOSE 8000 14579
ENTRYPOINT ["tini", "--", "baton"]
CMD ["--help"]

FROM runtime AS cuda
# Triton compiles a small C launcher for each kernel signature on first use: the CUDA image keeps
# gcc for it (and its Python headers are in the base image).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build-cuda /opt/baton /opt/baton
USER 10001

# Last, so that a plain `docker build .` gives the CPU image.
FROM runtime AS cpu
ENV BATON_KERNEL_DIR=/opt/baton/kernels
COPY --from=build-cpu /opt/baton /opt/baton
USER 10001
