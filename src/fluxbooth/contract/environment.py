"""Environment variables the worker passes to its child processes and they read."""

from __future__ import annotations

# Emulates a smaller GPU for benchmarks (bench/gpu.py): the share of the card the trainer may allocate, applied in
# its session stage (train/session.py) and passed through by the worker's allow-list (job/launch_files.py); unset on
# real workers.
CUDA_MEMORY_FRACTION_ENV = "FLUXBOOTH_CUDA_MEMORY_FRACTION"
# The trainer's CUDA allocator setting (PYTORCH_CUDA_ALLOC_CONF), set by job/launch_files.py and by the GPU probe
# (bench/gpu_probe.py). Expandable segments alone: with a split-size cap beside them the allocator fights itself
# (pytorch/pytorch#123548, #119452) and reserved memory grows.
CUDA_ALLOCATOR_SETTING = "expandable_segments:True"
