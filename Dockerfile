# fluxbooth worker image: CUDA runtime with the compiler DeepSpeed's ops need, pinned Python deps,
# DeepSpeed's CPU Adam prebuilt, and (optionally) a base model baked in.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends \
        software-properties-common ca-certificates curl git build-essential libaio-dev \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    FLUXBOOTH_CACHE_DIR=/opt/fluxbooth-cache \
    FLUXBOOTH_WORK_DIR=/tmp/fluxbooth-jobs \
    HF_HUB_DISABLE_TELEMETRY=1

WORKDIR /app
COPY requirements.txt pyproject.toml README.md ./
COPY src ./src
RUN python3.11 -m venv $VIRTUAL_ENV && pip install --no-cache-dir -r requirements.txt

COPY builder ./builder
# No GPU at build time: build the op for the architectures RunPod serves (Ampere, Ada, Hopper).
RUN TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0" DS_ACCELERATOR=cuda python builder/prebuild_ops.py

# Optional: bake a model. docker build --secret id=hf_token,src=token.txt --build-arg BASE_MODEL=black-forest-labs/FLUX.1-dev .
ARG BASE_MODEL=""
RUN --mount=type=secret,id=hf_token \
    if [ -n "$BASE_MODEL" ]; then python builder/fetch_model.py "$BASE_MODEL" /models/base; fi
ENV FLUXBOOTH_BASE_MODEL=${BASE_MODEL:+/models/base}

COPY handler.py test_input.json ./
CMD ["python", "-u", "handler.py"]
