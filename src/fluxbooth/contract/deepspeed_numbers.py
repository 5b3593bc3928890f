"""Every number written into the DeepSpeed JSON, in one place: launch_files.py writes them and the planner
(`fluxbooth.plan.memory`) counts the memory they cost. Torch-free and import-free on purpose, so both
sides can import it without importing each other.
"""

from __future__ import annotations

# ---- ZeRO-1/2: bucket sizes in elements. -------------------------------------------------------
ZERO2_REDUCE_BUCKET_ELEMENTS = 200_000_000
ZERO2_ALLGATHER_BUCKET_ELEMENTS = 200_000_000
# Those two are sized for a whole model; a LoRA gets buckets the size of its adapter (its trainable parameters,
# rounded up to whole multiples of this), since DeepSpeed allocates every bucket whole (2x the reduce bucket with
# overlap_comm) however few gradients fill it: 0.75 GiB of bf16 buckets for a 65 M-parameter adapter otherwise.
ZERO2_BUCKET_ROUNDING_ELEMENTS = 1 << 20


def zero2_bucket_elements(bucket_elements: int, trainable: int | None) -> int:
    """A ZeRO-1/2 bucket's size (`bucket_elements`, one of the constants above) for `trainable` trained parameters:
    the constant, or the trainable count rounded up to ZERO2_BUCKET_ROUNDING_ELEMENTS when that is smaller (at least
    the largest parameter, as DeepSpeed's contiguous gradients need). None (a hand-built plan): the constant. The
    DeepSpeed JSON (job/launch_files.py) and the planner's memory for the buckets (plan/memory) both read this."""
    if trainable is None:
        return bucket_elements
    rounding = ZERO2_BUCKET_ROUNDING_ELEMENTS
    return min(bucket_elements, -(-max(trainable, 1) // rounding) * rounding)


# ---- ZeRO-3: DiffSynth-Studio's low-VRAM settings (seed 004): small buckets, so the GPU holds little
# more than the layer being computed. ----------------------------------------------------------------
ZERO3_REDUCE_BUCKET_ELEMENTS = 50_000_000
ZERO3_PREFETCH_BUCKET_ELEMENTS = 50_000_000
ZERO3_SUB_GROUP_ELEMENTS = 1_000_000_000
ZERO3_PARAM_PERSISTENCE_THRESHOLD = 100_000
ZERO3_MAX_LIVE_PARAMETERS = 100_000_000
ZERO3_MAX_REUSE_DISTANCE = 100_000_000

# ---- NVMe offload: DeepSpeed's defaults, which launch_files.py leaves unset; the planner counts the pinned
# host buffers they cost (offload_param.buffer_count x buffer_size 16-bit elements, offload_optimizer's
# buffer_count fp32 buffers of one sub-group each) and the 16-bit parameter elements ZeRO-3 keeps in host
# RAM before the rest lives only on disk (offload_param.max_in_cpu). ---------------------------------
PARAM_SWAP_BUFFER_COUNT = 5
PARAM_SWAP_BUFFER_ELEMENTS = 100_000_000
OPTIMIZER_SWAP_BUFFER_COUNT = 4
PARAMS_KEPT_IN_CPU_ELEMENTS = 1_000_000_000

# ---- Asynchronous I/O for NVMe offload. ---------------------------------------------------------
AIO_BLOCK_SIZE = 1_048_576
AIO_QUEUE_DEPTH = 8
AIO_THREAD_COUNT = 1

# ---- Logging: never print DeepSpeed's step summaries (the trainer reports its own progress). ----
STEPS_PER_PRINT = 1_000_000_000
