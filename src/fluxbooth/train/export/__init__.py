"""Stages "save" and "export" of the trainer, one package:

- `stage`: the order (gather from the engine, release it, write each requested format, EMA too);
- `transformer`: the full model's files (diffusers folder, original-layout single file);
- `lora`: the LoRA's files (diffusers/peft and kohya/ComfyUI);
- `key_layouts`: diffusers ↔ original FLUX key names (pure tensor functions);
- `metadata`: what every exported safetensors file says about itself (pure).

The worker checks the files again, without torch, in `fluxbooth.storage.artifacts`.
"""
