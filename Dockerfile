# syntax=docker/dockerfile:1
# One image for the worker and the gateway (the gateway never imports torch, it just ships with it).
#   docker build -t genq .                                  # CUDA torch + CuPy kernels
#   docker build -t genq --build-arg TORCH_VARIANT=cpu --build-arg GENQ_EXTRAS=structured .   # CPU only
FROM python:3.11-slim

# TORCH_VARIANT picks the PyTorch wheel index: cpu, or a CUDA build such as cu130.
ARG TORCH_VARIANT=cu130
ARG TORCH_VERSION=2.13.0
# Extras of the genq distribution: gpu (CuPy) and kernels (NVRTC) for the CuPy attention path,
# structured (llguidance) for structured outputs.
ARG GENQ_EXTRAS=gpu,kernels,structured

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from its own index: installing genq afterwards finds torch satisfied and never
# pulls a different build from PyPI.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}"

WORKDIR /app
COPY . /app
# Editable, so engine/ finds the CUDA sources in /app/cuda at run time.
RUN if [ -n "${GENQ_EXTRAS}" ]; then pip install -e ".[${GENQ_EXTRAS}]"; \
    else pip install -e .; fi \
 && python -c "import torch, producer, worker, engine; print('torch', torch.__version__)" \
 && mkdir -p /models && ln -s /app/models/genq-tiny-stdlib /models/genq-tiny-stdlib

# /models/genq-tiny-stdlib is the committed demo model; mount a directory over /models to serve
# others (GENQ_MODEL in compose.yaml).
EXPOSE 8000
CMD ["genq", "--help"]
