# syntax=docker/dockerfile:1.7
# fluxbooth worker image for RunPod serverless.
#
# Two stages: `build` has CUDA's compiler and builds DeepSpeed's ops ahead of time; the final image is CUDA's
# minimal `base` flavour plus the built virtualenv, so torch's own nvidia-* wheels are its only CUDA libraries.
# Layers run from the slowest-changing to the fastest: system packages, torch, the other pinned
# dependencies, DeepSpeed with its ops, an optional baked model, and the source last, so a code change
# rebuilds seconds of image, not the multi-GB dependency layers.
#
#   docker build -t fluxbooth .
#   docker build --secret id=hf_token,src=token.txt --build-arg BASE_MODEL=black-forest-labs/FLUX.1-dev -t fluxbooth .

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu22.04

# ------------------------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends \
        software-properties-common ca-certificates git build-essential libaio-dev \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3.11 -m venv $VIRTUAL_ENV
WORKDIR /build

# torch's CUDA build first, pinned, and checked: a wrong wheel fails the build here, not a job on a GPU.
COPY requirements-cuda.txt ./
RUN pip install -r requirements-cuda.txt \
    && python -c "import torch; assert torch.version.cuda == '12.8', torch.version.cuda; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_arch_list())"

# Every other pinned dependency except DeepSpeed, which is built below with its ops. torch==2.13.0 in
# requirements.txt is already met by 2.13.0+cu128; the check proves nothing replaced it.
COPY requirements.txt ./
RUN grep -v '^deepspeed==' requirements.txt > requirements-without-deepspeed.txt \
    && pip install -r requirements-without-deepspeed.txt \
    && python -c "import torch; assert torch.version.cuda == '12.8', torch.version.cuda"

# DeepSpeed with its ops compiled into the package (ds_report: installed [YES]), so no cold start runs nvcc:
# the fused GPU optimizers for every GPU generation RunPod rents (Ampere 8.0/8.6, Ada 8.9, Hopper 9.0,
# Blackwell 10.0/12.0; nvcc 12.8 and torch's cu128 build cover them all, no GPU needed to build), the CPU
# optimizers for offload, and async_io for NVMe offload. builder/portable-cxx replaces DeepSpeed's
# hard-coded -march=native (and the build host's AVX-512) with portable x86-64-v3 flags.
COPY builder/portable-cxx builder/verify_ds_ops.py ./builder/
ENV TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0"
RUN DS_ACCELERATOR=cuda DS_BUILD_OPS=0 \
        DS_BUILD_FUSED_ADAM=1 DS_BUILD_FUSED_LION=1 \
        DS_BUILD_CPU_ADAM=1 DS_BUILD_CPU_ADAGRAD=1 DS_BUILD_CPU_LION=1 \
        DS_BUILD_AIO=1 \
        CXX=/build/builder/portable-cxx MAX_JOBS=4 \
        pip install --no-build-isolation "$(grep '^deepspeed==' requirements.txt)" \
    && DS_ACCELERATOR=cuda ds_report > /tmp/ds_report.txt \
    && python builder/verify_ds_ops.py /tmp/ds_report.txt

# ------------------------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU}

ARG DEBIAN_FRONTEND=noninteractive
# libaio1 for async_io; gcc and the Python headers for Triton, which compiles a small launcher at run time.
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common ca-certificates \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
        libaio1 gcc libc6-dev \
    && apt-get purge -y software-properties-common && apt-get autoremove -y \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv

# Hugging Face's cache on the network volume, where RunPod puts an endpoint's cached model
# (/runpod-volume/huggingface-cache/hub) and where a download survives the worker.
# RUNPOD_LOG_LEVEL=INFO: the SDK's default, DEBUG, logs every job's input (the dataset's base64) and its
# result (presigned URLs).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app/src \
    RUNPOD_LOG_LEVEL=INFO \
    HF_HOME=/runpod-volume/huggingface-cache \
    HF_HUB_CACHE=/runpod-volume/huggingface-cache/hub \
    HF_HUB_DISABLE_TELEMETRY=1 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    FLUXBOOTH_CACHE_DIR=/opt/fluxbooth-cache \
    FLUXBOOTH_WORK_DIR=/tmp/fluxbooth-jobs
WORKDIR /app

# Optional: a base model baked into the image, as a Hugging Face cache under /models (FLUXBOOTH_BAKED_MODELS_DIR).
# The token is a build secret, never a build arg, so no layer keeps it.
ARG BASE_MODEL=""
COPY builder/fetch_model.py ./builder/
RUN --mount=type=secret,id=hf_token \
    if [ -n "$BASE_MODEL" ]; then python builder/fetch_model.py "$BASE_MODEL" /models; fi
ENV FLUXBOOTH_BASE_MODEL=${BASE_MODEL:-black-forest-labs/FLUX.1-dev}

# The source, last.
COPY pyproject.toml README.md handler.py test_input.json ./
COPY builder ./builder
COPY src ./src
RUN python -c "import handler, fluxbooth.cli" && python -m fluxbooth --help > /dev/null

CMD ["python", "-u", "handler.py"]
