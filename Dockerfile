# syntax=docker/dockerfile:1.7
# fluxbooth worker image for RunPod serverless: the image RunPod pulls (docs/image.md).
#
# Two stages: `build` installs torch and compiles DeepSpeed's host ops into the virtualenv; the final image is
# the runtime base plus that virtualenv. Everything comes from a plain Debian base and PyPI: torch 2.13.0 from
# PyPI is the CUDA 13.0 build, whose nvidia-* wheels are the image's only CUDA libraries. No CUDA toolkit and
# no nvcc: the GPU optimizers are torch's own (fused AdamW, a torch Lion), and DeepSpeed's ops the trainer
# loads (CPU Adam, Adagrad and Lion for optimizer offload, async_io for NVMe offload) are host C++.
# Layers run from the slowest-changing to the fastest: system packages, torch, DeepSpeed with its ops, the
# other pinned dependencies, an optional baked model, and the source last, so a code change rebuilds seconds
# of image, not the multi-GB dependency layers.
#
# Build arguments (docs/image.md):
#   SCORING_MODELS=1          bakes the likeness scoring models (DINOv2, SigLIP) into /models (1/0, true/false,
#                             yes/no, on/off; anything else fails the build)
#   CAPTION_MODEL=1           bakes the default captioner (Qwen3-VL-2B-Instruct) into /models (the same spellings)
#   BASE_MODEL, BASE_MODEL_REVISION  a hub id baked into /models, at that branch, tag or commit
#   BUILD_BASE, RUNTIME_BASE  the two stages' images: Debian 12 (bookworm, Python 3.11) by default. Any Debian
#                             or Ubuntu image with apt works (this file installs Python itself); use the same
#                             release for both stages.
#
#   docker build -t fluxbooth .
#   docker build --secret id=hf_token,src=token.txt --build-arg BASE_MODEL=black-forest-labs/FLUX.1-dev -t fluxbooth .
#   python builder/image.py build     # the same image from an mmdebstrap-made bookworm base, with buildah (no daemon)

ARG BUILD_BASE=debian:bookworm-slim
ARG RUNTIME_BASE=debian:bookworm-slim

# ------------------------------------------------------------------------------------------------------------
FROM ${BUILD_BASE} AS build

ARG DEBIAN_FRONTEND=noninteractive
# The distribution's own Python (3.11 on Debian 12): no third-party archive to reach. libaio-dev for
# DeepSpeed's async_io op (NVMe offload); g++ for DeepSpeed's host ops.
RUN apt-get update && apt-get install -y --no-install-recommends \
        ca-certificates python3 python3-venv python3-dev build-essential libaio-dev \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv $VIRTUAL_ENV
WORKDIR /build

# torch first, pinned, and checked: a CPU-only or wrong wheel fails the build here, not a job on a GPU.
# pip's downloads stay in a build cache between builds (no layer keeps them).
COPY requirements-torch-cuda.txt ./
COPY builder/image_checks.py ./builder/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -r requirements-torch-cuda.txt \
    && python builder/image_checks.py torch

# DeepSpeed with its host ops compiled into the package (ds_report: installed [YES]), recorded for the CUDA
# accelerator a GPU worker runs with, so no worker JIT-builds them: with no CUDA toolkit in the build,
# DeepSpeed builds them as C++ extensions (builder/verify_ds_ops.py says why that is the worker's op).
# builder/portable-cxx replaces DeepSpeed's hard-coded -march=native (and the build host's AVX-512) with
# portable x86-64-v3 flags. Before the other dependencies, from a requirements file of its own: changing
# any other pin does not recompile the ops.
COPY requirements-deepspeed.txt ./
COPY builder/portable-cxx builder/verify_ds_ops.py ./builder/
RUN --mount=type=cache,target=/root/.cache/pip \
    grep -v '^deepspeed==' requirements-deepspeed.txt > deepspeed-needs.txt \
    && pip install -r deepspeed-needs.txt \
    && env $(python builder/verify_ds_ops.py build-env) CXX=/build/builder/portable-cxx MAX_JOBS=2 \
        pip install --no-build-isolation --no-deps "$(grep '^deepspeed==' requirements-deepspeed.txt)" \
    && env $(python builder/verify_ds_ops.py accelerator-env) ds_report > /tmp/ds_report.txt \
    && python builder/verify_ds_ops.py check /tmp/ds_report.txt

# The ops the demo job loads on DeepSpeed's CPU accelerator (the one it selects on a machine without a GPU:
# CI runs the demo in this image on a CPU): CPU Adam and the shared-memory collectives, JIT-built once here
# into TORCH_EXTENSIONS_DIR, where a job's op load finds them up to date instead of compiling them. Through
# the same portable compiler, kept in the image at the same path (the runtime's CXX), so the op load sees the
# same build command and rebuilds nothing. The lock files of a finished build go too.
COPY builder/prebuild_ops.py ./builder/
RUN cp builder/portable-cxx /opt/venv/bin/portable-cxx \
    && DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/opt/torch_extensions CXX=/opt/venv/bin/portable-cxx MAX_JOBS=2 \
        python builder/prebuild_ops.py CPUAdamBuilder ShareMemCommBuilder \
    && find /opt/torch_extensions -name lock -delete

# Every other pinned dependency, but not the project itself (its source is copied last, into the final
# stage). torch==2.13.0 in requirements.txt is already met by the torch installed above, and DeepSpeed's
# pins by the layer above; the check proves nothing replaced torch. The face models likeness scoring does not
# load (dlib's 68-point landmarks, whose training images exclude commercial use, and its CNN detector) are
# removed in the same layer, so no layer ships them.
COPY requirements.txt builder/face_models.py ./
RUN --mount=type=cache,target=/root/.cache/pip \
    grep -v '^-e ' requirements.txt > requirements-image.txt \
    && pip install -r requirements-image.txt \
    && python builder/image_checks.py torch \
    && python face_models.py

# ------------------------------------------------------------------------------------------------------------
FROM ${RUNTIME_BASE}

ARG DEBIAN_FRONTEND=noninteractive
# Python of the same release as the build stage (the virtualenv links to it). libaio-dev, gcc and libc6-dev:
# DeepSpeed's async_io decides whether NVMe offload works by compiling and linking a probe against the
# unversioned libaio.so (AsyncIOBuilder.is_compatible), which libaio1 alone does not ship. gcc and the
# Python headers are also what Triton compiles its small launcher with at run time; g++ lets an op that is
# not prebuilt (another DeepSpeed accelerator) still build, on the CPU, without nvcc.
RUN apt-get update && apt-get install -y --no-install-recommends \
        ca-certificates python3 python3-dev libaio-dev gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/torch_extensions /opt/torch_extensions

# Hugging Face's cache on the network volume, where RunPod puts an endpoint's cached model
# (/runpod-volume/huggingface-cache/hub) and where a download survives the worker. Whether that folder is
# really a persistent volume is decided from the mounts at run time (settings.volume_is_mounted), not from the
# folder existing: without a network volume this path is on the container disk.
# RUNPOD_LOG_LEVEL=INFO: the SDK's default, DEBUG, logs every job's input (the dataset's base64) and its
# result (presigned URLs).
# RUNPOD_SKIP_AUTO_SYSTEM_CHECKS=true: runpod 1.12's automatic system checks import torch and open a CUDA
# context in the handler process for the worker's whole life (VRAM the trainer loses); the worker runs its
# own start checks (the doctor), in a subprocess.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app/src \
    RUNPOD_LOG_LEVEL=INFO \
    RUNPOD_SKIP_AUTO_SYSTEM_CHECKS=true \
    HF_HOME=/runpod-volume/huggingface-cache \
    HF_HUB_CACHE=/runpod-volume/huggingface-cache/hub \
    HF_HUB_DISABLE_TELEMETRY=1 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions \
    CXX=/opt/venv/bin/portable-cxx \
    FLUXBOOTH_CACHE_DIR=/opt/fluxbooth-cache \
    FLUXBOOTH_WORK_DIR=/tmp/fluxbooth-jobs
WORKDIR /app

# Optional: a base model baked into the image, as a Hugging Face cache under /models (FLUXBOOTH_BAKED_MODELS_DIR).
# The token is a build secret, never a build arg, so no layer keeps it.
# BASE_MODEL_REVISION pins the branch, tag or commit baked (unset: the default branch as it is at build time).
# The values go to fetch_model.py as `--model=VALUE`, never as words of their own, so a value starting with
# `--` is refused as no hub id instead of read as an option.
ARG BASE_MODEL=""
ARG BASE_MODEL_REVISION=""
COPY builder/fetch_model.py ./builder/
RUN --mount=type=secret,id=hf_token \
    python builder/fetch_model.py --model="$BASE_MODEL" --revision="$BASE_MODEL_REVISION" /models
ENV FLUXBOOTH_BASE_MODEL=${BASE_MODEL:-black-forest-labs/FLUX.1-dev}
# Optional: the likeness scoring models (DINOv2-small and SigLIP-base, Apache-2.0) at their pinned
# revisions, in the same cache, so a worker without network scores pets and objects and prompt fidelity.
ARG SCORING_MODELS=0
# 1/0, true/false, yes/no, on/off (any case); fetch_model.py fails the build on any other value.
RUN python builder/fetch_model.py --scoring-models="$SCORING_MODELS" /models
# Optional: the default captioner of `captioning: "missing"` (Qwen3-VL-2B-Instruct, Apache-2.0, 4.26 GB) at its
# pinned revision, so a worker without network captions photos.
ARG CAPTION_MODEL=0
RUN python builder/fetch_model.py --caption-model="$CAPTION_MODEL" /models

# The source, last.
COPY pyproject.toml README.md NOTICE handler.py test_input.json ./
COPY builder ./builder
COPY src ./src
RUN python -c "import handler, fluxbooth.cli" && python -m fluxbooth --help > /dev/null

CMD ["python", "-u", "handler.py"]
