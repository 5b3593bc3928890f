"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") in torch `_foreach_*` ops.

The optimizer the trainer steps for "lion" when DeepSpeed does not offload it (then DeepSpeed's host C++
DeepSpeedCPULion steps instead): DeepSpeed's GPU Lion (FusedLion) is a CUDA op that needs nvcc to build, and
this runs on whatever device the parameters are on. Per parameter p with gradient g and momentum m:

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

One state tensor (`exp_avg`, the name DeepSpeed's Lion uses), as many bytes as the parameter.
sign(0) is 0, as in the paper: a parameter whose gradient and momentum are both zero does not move (DeepSpeed's
kernels move it by lr, their sign of 0 being +1 or -1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

# The update works on slices of at most this many elements at a time, so its one scratch tensor (the interpolated
# momentum) stays small: ZeRO-1/2 hand the optimizer one flat partition per group, the size of every trainable
# parameter together, and a scratch copy of that would cost 4 bytes per trained parameter on the device.
SLICE_ELEMENTS = 1 << 22


class Lion(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Lion's learning rate must be >= 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Lion's betas must lie in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lion does not support sparse gradients")
            moments = [self._momentum(p) for p in params]
            beta1, beta2 = group["betas"]
            for batch in _slice_batches(params, moments):
                _lion_update(
                    *batch, lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"]
                )
        return loss

    def _momentum(self, parameter: torch.Tensor) -> torch.Tensor:
        state = self.state[parameter]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        return state["exp_avg"]


def _slices(*tensors: torch.Tensor) -> Iterable[tuple[torch.Tensor, ...]]:
    """Matching views of same-shaped `tensors` of at most SLICE_ELEMENTS each (whole when one of them is not
    contiguous: it has no flat view)."""
    if not all(tensor.is_contiguous() for tensor in tensors):
        return [tensors]
    return zip(*(tensor.view(-1).split(SLICE_ELEMENTS) for tensor in tensors), strict=True)


def _slice_batches(
    params: list[torch.Tensor], moments: list[torch.Tensor]
) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]:
    """(params, grads, moments) slices, in batches of about SLICE_ELEMENTS elements on one device and dtype."""
    batch: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
    elements = 0
    for parameter, moment in zip(params, moments, strict=True):
        grad = parameter.grad
        assert grad is not None
        if batch[0] and (batch[0][0].device, batch[0][0].dtype) != (parameter.device, parameter.dtype):
            yield batch
            batch, elements = ([], [], []), 0
        for piece in _slices(parameter, grad, moment):
            for target, tensor in zip(batch, piece, strict=True):
                target.append(tensor)
            elements += piece[0].numel()
            if elements >= SLICE_ELEMENTS:
                yield batch
                batch, elements = ([], [], []), 0
    if batch[0]:
        yield batch


def _lion_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moments: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    interpolated = torch._foreach_mul(moments, beta1)
    torch._foreach_add_(interpolated, grads, alpha=1.0 - beta1)
    torch._foreach_sign_(interpolated)
    if weight_decay != 0.0:
        # Decoupled weight decay, as in AdamW: shrink the weight, not the gradient.
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, interpolated, alpha=-lr)
    torch._foreach_mul_(moments, beta2)
    torch._foreach_add_(moments, grads, alpha=1.0 - beta2)
