#!/usr/bin/env bash
# Prepare, on a machine with network access, the wheels a lent GPU machine lacks (see docs/gpu.md).
#
# The GPU machine runs Python 3.12 with CUDA torch, accelerate, transformers, peft, safetensors,
# huggingface-hub, tokenizers, sentencepiece, protobuf, einops, ninja, psutil, py-cpuinfo, msgpack,
# nvidia-ml-py and pillow, and cannot download anything. `python -m fluxbooth train` and the trainer
# also import diffusers, DeepSpeed, pydantic and PyYAML; those (and their dependencies that the machine
# may lack) go into .whl/ at the versions requirements.txt pins. Never torch.
#
# Usage: bench/gpu_wheels.sh [PYTHON]   (PYTHON builds the DeepSpeed wheel; default .venv/bin/python)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
python="${1:-$root/.venv/bin/python}"
out="$root/.whl"
requirements="$root/requirements.txt"

# Pure-Python or cp312 binary wheels, each at requirements.txt's pin. Dependencies are named one by
# one because --no-deps fetches none: diffusers needs importlib_metadata (+ zipp) and requests
# (+ urllib3, idna, charset-normalizer, certifi); pydantic needs its core, annotated-types,
# typing-inspection and a recent typing_extensions; DeepSpeed needs hjson; the dataset stage opens HEIC through pi-heif.
packages=(
    diffusers importlib_metadata zipp
    requests urllib3 idna charset-normalizer certifi
    pydantic pydantic_core annotated-types typing-inspection typing_extensions
    hjson pyyaml pi-heif
)

pin() {
    # The `name==version` line of requirements.txt (or the DeepSpeed pins it includes) for a package, - and _ alike.
    local wanted
    wanted="$(echo "$1" | tr '_' '-' | tr '[:upper:]' '[:lower:]')"
    while IFS= read -r line; do
        local name="${line%%==*}"
        if [[ "$(echo "$name" | tr '_' '-' | tr '[:upper:]' '[:lower:]')" == "$wanted" && "$line" == *"=="* ]]; then
            echo "$line"
            return 0
        fi
    done < <(cat "$requirements" "$root/requirements-deepspeed.txt")
    echo "no pin for $1 in $requirements" >&2
    return 1
}

rm -rf "$out"
mkdir -p "$out"
pinned=()
for package in "${packages[@]}"; do
    pinned+=("$(pin "$package")")
done

"$python" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$out" "${pinned[@]}"

# DeepSpeed is published only as a source archive: build a pure-Python wheel with no prebuilt ops
# (they compile on the GPU machine, which has nvcc, on first use). No build isolation, so the build
# uses the torch already installed here instead of downloading another one.
DS_BUILD_OPS=0 "$python" -m pip wheel --quiet --no-deps --no-build-isolation -w "$out" "$(pin deepspeed)"

ls -1 "$out"
du -sh "$out"
