"""Loading the FLUX transformer for training (its family's class): plain, or partitioned under ZeRO-3; LoRA adapters."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.utils.checkpoint
from peft import LoraConfig
from safetensors import safe_open

from fluxbooth.contract.precision import QUANTISED_PRECISIONS
from fluxbooth.contract.settings_groups import checkpointed_blocks
from fluxbooth.contract.trainer_config import LoraSettings
from fluxbooth.train.base_model import TRANSFORMER_SUBFOLDER, BaseModel, transformer_weight_files
from fluxbooth.train.blockswap import BlockSwapper, attach_swapper, check_block_swap, flux_blocks
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.quantize import check_base_precision, load_quantised_base, residency
from fluxbooth.train.state import Session


def load_trainable_transformer(session: Session) -> tuple[Any, dict[str, Any]]:
    """The transformer ready for the engine: partitioned under ZeRO-3, LoRA adapters added or every
    weight trainable, gradient checkpointing as asked. Also how it was loaded (metrics.transformer_loading)."""
    config, base_folder = session.config, str(session.base.folder)
    check_base_precision(config.memory.base_precision, config.training_type, session.zero_stage)
    report: dict[str, Any] = {"method": "from_pretrained"}
    if config.memory.block_swap:
        check_block_swap(
            config.training_type,
            config.memory.checkpoint_every == 1,
            session.zero_stage,
            config.memory.fused_backward_pass,
        )
        # Built in host RAM tensor by tensor (quantised there); its blocks are handed to the swapper below.
        transformer = load_quantised_base(
            base_folder, config.memory.base_precision, torch.device("cpu"), session.precision.load_dtype
        )
        report = {"method": "block_swap", **residency(transformer)}
    elif config.memory.base_precision in QUANTISED_PRECISIONS:
        # Quantised layer by layer straight onto the accelerator: the bf16 base is never whole anywhere.
        transformer = load_quantised_base(
            base_folder, config.memory.base_precision, session.accelerator.device, session.precision.load_dtype
        )
        report = {"method": "quantised_layer_by_layer", **residency(transformer)}
    elif session.zero_stage == 3:
        assert session.deepspeed_config is not None
        transformer = load_transformer_zero3(
            session.base, session.precision.load_dtype, session.deepspeed_config, session.is_main
        )
        report = {"method": "zero3_init", **partitioning_report(transformer)}
        if report["materialised_elements"] or report["partitioned"] != report["parameters"]:
            raise TrainerFailure("trainer_failed", f"ZeRO-3 loading left parameters whole: {report}")
    else:
        transformer = load_transformer(session.base, session.precision.load_dtype)
    if config.training_type == "lora":
        add_lora_adapter(transformer, config.lora)
        if session.deepspeed_config is None:
            # The trained adapter stays fp32 under autocast, as diffusers' LoRA scripts keep it.
            for parameter in transformer.parameters():
                if parameter.requires_grad:
                    parameter.data = parameter.data.to(torch.float32)
    else:
        transformer.requires_grad_(True)
    report["checkpointed_blocks"] = enable_checkpointing(transformer, config.memory.checkpoint_every)
    if config.memory.block_swap:
        report["block_swap"] = _swap_blocks(
            transformer, session.accelerator.device, trained=config.training_type == "full"
        )
    transformer.train()
    return transformer, report


def _swap_blocks(transformer: Any, device: torch.device, *, trained: bool) -> dict[str, Any]:
    """Hand the blocks to a BlockSwapper streaming them to `device` (their frozen tensors; with `trained`, the
    fused full fine-tune's, their trained weights too), kept with the model (`release_swapped_blocks`), and move
    the rest (embedders, output, the LoRA weights) to `device`."""
    swapper = BlockSwapper(flux_blocks(transformer), device, swap_trainable=trained)
    attach_swapper(transformer, swapper)
    swapper.place_the_rest(transformer)
    return {
        "blocks": len(flux_blocks(transformer)),
        "host_bytes": swapper.host_bytes(),
        "largest_block_bytes": swapper.largest_block_bytes(),
        "trained_weights_swapped": swapper.trains,
    }


def load_transformer(base: BaseModel, dtype: torch.dtype) -> Any:
    return base.ops.transformer_class.from_pretrained(
        str(base.folder), subfolder=TRANSFORMER_SUBFOLDER, torch_dtype=dtype
    )


def load_transformer_zero3(
    base: BaseModel, dtype: torch.dtype, deepspeed_config: dict[str, Any], is_source_rank: bool
) -> Any:
    """Build the transformer already partitioned (deepspeed.zero.Init) and stream the weights in.

    Each rank only ever holds its partition (on the CPU when parameters are offloaded); one module's
    full parameters are gathered at a time while rank 0 copies them in from the safetensors files, so
    the whole model never exists on one GPU or in one process.
    """
    transformer_class = base.ops.transformer_class
    config = dict(base.transformer_config)
    remote_device = deepspeed_config.get("zero_optimization", {}).get("offload_param", {}).get("device")
    # No `dtype=`: zero.Init then takes it from the JSON's bf16/fp16 sections, as the engine will. (An explicit
    # dtype is also ignored on accelerators without fp16, which then get bf16: an operator-precedence slip in
    # deepspeed 0.19's Init._set_dtype.)
    with deepspeed.zero.Init(
        config_dict_or_path=deepspeed_config,
        remote_device=remote_device if remote_device in ("cpu", "nvme") else None,
    ):
        model = transformer_class.from_config(config)
    if next(model.parameters()).dtype != dtype:
        raise TrainerFailure(
            "trainer_failed",
            f"zero.Init built {next(model.parameters()).dtype} parameters, the DeepSpeed JSON asks for {dtype}",
        )
    _stream_weights_into_partitioned_model(model, transformer_weight_files(base.folder), is_source_rank)
    return model.eval()


def _stream_weights_into_partitioned_model(model: torch.nn.Module, files: list[Path], is_source_rank: bool) -> None:
    with _open_safetensors(files if is_source_rank else []) as tensor_source:
        expected: set[str] = set()
        for module_name, module in model.named_modules():
            parameters = dict(module.named_parameters(recurse=False))
            prefix = f"{module_name}." if module_name else ""
            expected.update(prefix + name for name in parameters)
            if parameters:
                # Collective: every rank gathers the same module, rank 0 writes, the result is re-partitioned.
                with deepspeed.zero.GatheredParameters(list(parameters.values()), modifier_rank=0):
                    if is_source_rank:
                        for name, parameter in parameters.items():
                            parameter.data.copy_(tensor_source.get(prefix + name, parameter.shape))
            for name, buffer in module.named_buffers(recurse=False):
                if prefix + name in tensor_source.keys:
                    buffer.data.copy_(tensor_source.get(prefix + name, buffer.shape))
        if is_source_rank:
            missing = expected - tensor_source.keys
            if missing:
                raise TrainerFailure(
                    "invalid_config",
                    f"the base transformer's weights lack {len(missing)} tensors, e.g. {sorted(missing)[:3]}",
                )


class _TensorSource:
    def __init__(self, handles: list[Any]) -> None:
        self._handles = {}
        for handle in handles:
            for key in handle.keys():
                self._handles[key] = handle
        self.keys = set(self._handles)

    def get(self, key: str, shape: torch.Size) -> torch.Tensor:
        if key not in self._handles:
            raise TrainerFailure("invalid_config", f"the base transformer's weights lack {key!r}")
        tensor = self._handles[key].get_tensor(key)
        if tuple(tensor.shape) != tuple(shape):
            raise TrainerFailure(
                "invalid_config",
                f"the base transformer's {key!r} has shape {tuple(tensor.shape)}, the model expects {tuple(shape)}",
            )
        return tensor


@contextmanager
def _open_safetensors(files: list[Path]) -> Iterator[_TensorSource]:
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(path), framework="pt", device="cpu")) for path in files]
        yield _TensorSource(handles)


def partitioning_report(model: torch.nn.Module) -> dict[str, Any]:
    """How the parameters are held: under ZeRO-3 each is a DeepSpeed parameter whose local tensor is
    empty (the full tensor was never kept) and whose partition lives on the offload device."""
    parameters = list(model.parameters())
    partitioned = [parameter for parameter in parameters if hasattr(parameter, "ds_tensor")]
    devices = sorted({parameter.ds_tensor.device.type for parameter in partitioned})
    return {
        "parameters": len(parameters),
        "partitioned": len(partitioned),
        "materialised_elements": sum(parameter.numel() for parameter in partitioned),
        "partition_devices": devices,
    }


def add_lora_adapter(transformer: Any, settings: LoraSettings) -> None:
    """Freeze the base and add peft LoRA layers (gaussian init, as diffusers' FLUX LoRA script)."""
    transformer.requires_grad_(False)
    transformer.add_adapter(
        LoraConfig(
            r=settings.rank,
            lora_alpha=settings.alpha,
            lora_dropout=settings.dropout,
            init_lora_weights="gaussian",
            target_modules=list(settings.target_modules),
        )
    )
    if not any(parameter.requires_grad for parameter in transformer.parameters()):
        raise TrainerFailure(
            "invalid_config",
            f"lora_target_modules {list(settings.target_modules)} match no layer of the transformer; "
            "use names of its Linear layers, like to_q, to_k, to_v",
        )


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def enable_checkpointing(transformer: Any, every: int) -> int:
    """Activation checkpointing of every `every`-th block of the double and of the single stack (the planner's
    Plan.checkpoint_every; 0: none); how many blocks are checkpointed. diffusers hands each block of the forward
    to the function given to `enable_gradient_checkpointing` while grad is enabled: the chosen blocks go through
    torch's checkpoint, the others run plainly and keep what they save."""
    stacks = (transformer.transformer_blocks, transformer.single_transformer_blocks)
    chosen = {id(stack[index]) for stack in stacks for index in checkpointed_blocks(len(stack), every)}
    if every == 1:
        transformer.enable_gradient_checkpointing()
    elif chosen:

        def some_blocks(block: torch.nn.Module, *args: Any) -> Any:
            if id(block) in chosen:
                return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)
            return block(*args)

        transformer.enable_gradient_checkpointing(gradient_checkpointing_func=some_blocks)
    return len(chosen)
