"""The cost of the CPU EMA (train/ema.py, the request's `ema_decay`) per optimizer step: every trained weight
copied to the host and cast to fp32, then the fp32 shadow updated in place (`mul_` then `add_`). For a LoRA it
is nothing; for a full fine-tune of FLUX.1 it is about 24 GB over the host link and some 300 GB of host-memory
traffic every step, seconds that the deadline check must see. The shadow's own host bytes are a memory term
(`host.ema_shadow` in plan/memory/model_states.py). No torch here.
"""

from __future__ import annotations

# Host-memory traffic of one EMA update per trained element beyond reading the 16-bit weight: the fp32 copy
# written and read back (4 + 4), `shadow.mul_` reading and writing the shadow (4 + 4), `shadow.add_` reading it
# and writing it again (4 + 4).
EMA_UPDATE_TRAFFIC_BYTES_PER_PARAM = 24


def ema_update_seconds(
    trainable: int, width: int, link_bytes_per_second: float | None, memory_bytes_per_second: float
) -> float:
    """Seconds of one EMA update: the `trainable` weights (`width` bytes each) over the host link
    (`link_bytes_per_second`; None where the weights already live in host RAM), then the update's host-memory
    traffic at `memory_bytes_per_second`."""
    transfer = trainable * width / link_bytes_per_second if link_bytes_per_second else 0.0
    return transfer + trainable * (width + EMA_UPDATE_TRAFFIC_BYTES_PER_PARAM) / memory_bytes_per_second
