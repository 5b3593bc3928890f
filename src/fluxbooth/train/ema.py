"""An exponential moving average of the trained weights, kept in fp32 on the main process's CPU (as
SimpleTuner does), so it costs no GPU memory. Under ZeRO-3 the parameters are gathered for each update,
which is why `from_model` and `update` are collective: every rank calls them, only rank 0 stores."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import deepspeed
import torch


def export_key(parameter_name: str) -> str:
    """peft's parameter names carry the adapter name (`lora_A.default.weight`); exports do not."""
    return parameter_name.replace(".default.", ".")


def _gathered(parameters: list[torch.nn.Parameter]) -> Any:
    if any(hasattr(parameter, "ds_id") for parameter in parameters):
        return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)
    return nullcontext()


class CpuEma:
    def __init__(self, decay: float, is_main_process: bool) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay must be between 0 and 1, got {decay}")
        self.decay = decay
        self.is_main_process = is_main_process
        self.shadow: dict[str, torch.Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.updates = 0

    @classmethod
    def from_model(cls, model: torch.nn.Module, decay: float, is_main_process: bool = True) -> CpuEma:
        ema = cls(decay, is_main_process)
        for name, parameter in ema._trained(model):
            with _gathered([parameter]):
                if is_main_process:
                    ema.shadow[export_key(name)] = parameter.detach().to("cpu", dtype=torch.float32, copy=True)
                    ema.dtypes[export_key(name)] = parameter.dtype
        return ema

    @staticmethod
    def _trained(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for name, parameter in self._trained(model):
            with _gathered([parameter]):
                if self.is_main_process:
                    current = parameter.detach().to("cpu", dtype=torch.float32)
                    self.shadow[export_key(name)].mul_(self.decay).add_(current, alpha=1.0 - self.decay)
        self.updates += 1

    def export_state(self) -> dict[str, torch.Tensor]:
        """The averaged weights, in the dtype the model trains them in."""
        return {name: value.to(self.dtypes[name]).contiguous() for name, value in self.shadow.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.is_main_process:
            missing = set(self.shadow) - set(state["shadow"])
            if missing:
                raise ValueError(f"EMA state lacks {sorted(missing)[:3]}")
            self.shadow = {name: tensor.float() for name, tensor in state["shadow"].items()}
        self.updates = int(state["updates"])
