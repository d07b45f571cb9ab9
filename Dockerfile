# syntax=docker/dockerfile:1
# One image for the worker and the gateway (the gateway never imports torch, it just ships with it).
#   docker build -t genq .                                  # CUDA torch + CuPy kernels
#   docker build -t genq --build-arg TORCH_VARIANT=cpu --build-arg GENQ_EXTRAS=worker,gateway,structured .   # CPU only

# The wheel, built from the sources it ships (its kernel sources, cuda/, travel inside it as
# package data): the image installs that, never an editable checkout.
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY worker worker
COPY producer producer
COPY cuda cuda
RUN pip install --no-cache-dir --disable-pip-version-check --quiet "setuptools>=77" wheel \
 && pip wheel --no-deps --no-build-isolation --wheel-dir /dist .

FROM python:3.11-slim

# TORCH_VARIANT picks the PyTorch wheel index: cpu, or a CUDA build such as cu130.
ARG TORCH_VARIANT=cu130
ARG TORCH_VERSION=2.13.0
# Extras of the genq distribution: worker (torch, transformers: `genq worker`), gateway (FastAPI:
# `genq gateway`), gpu (CuPy) and kernels (NVRTC) for the CuPy attention path, structured
# (llguidance) for structured outputs.
ARG GENQ_EXTRAS=worker,gateway,gpu,kernels,structured

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from its own index: installing genq afterwards finds torch satisfied and never
# pulls a different build from PyPI.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}"

COPY --from=wheel /dist /dist
# The installed engine finds its kernel sources in the wheel (engine/cuda_sources).
RUN pip install "$(ls /dist/genq-*.whl)[${GENQ_EXTRAS}]" && rm -rf /dist \
 && python -c "import torch, producer, worker; from engine import kernels; \
assert (kernels.CUDA_DIR / 'paged_attention.cu').is_file(), kernels.CUDA_DIR; \
print('torch', torch.__version__, 'kernel sources', kernels.CUDA_DIR)"

# /models/genq-tiny-stdlib is the committed demo model; mount a directory over /models to serve
# others (GENQ_MODEL in compose.yaml).
COPY models/genq-tiny-stdlib /models/genq-tiny-stdlib
WORKDIR /app
EXPOSE 8000
CMD ["genq", "--help"]
