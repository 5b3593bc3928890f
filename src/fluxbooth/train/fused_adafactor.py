"""A full fine-tune without master weights or a gradient buffer, as kohya's sd-scripts runs FLUX.1
(`flux_train.py --optimizer_type adafactor --fused_backward_pass --full_bf16`): the weights stay in bf16,
and each weight is stepped by transformers' Adafactor the moment its gradient has been accumulated during
the backward pass (a `register_post_accumulate_grad_hook` per parameter), after which its gradient is freed.
At most one parameter's gradient and its fp32 working copies exist at a time.

The update itself is transformers' `Adafactor.step` run on an fp32 copy of one weight; the result is
rounded back to bf16 stochastically (an update far below one bf16 ulp would otherwise round away to
nothing, every step). What a fused pass cannot do, and what it does instead:
- gradient accumulation: a weight is stepped before the next micro-batch exists, and keeping its gradient
  would be the very buffer the pass avoids; refused (kohya refuses it too).
- clipping by the global gradient norm: that norm is known only once every gradient exists, by which time
  most weights have been stepped; each parameter's gradient is clipped to `max_grad_norm` on its own
  (kohya's hook does the same), and Adafactor clips each update to an RMS of `clip_threshold` (1.0).
- data parallelism: DDP reduces gradients after the hooks fire; one process only.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from transformers.optimization import Adafactor

from fluxbooth.contract.names import OPTIMIZER_HYPERPARAMETERS, normalise_optimizer_name
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.state import seed_for

# The float32 bits below bf16's mantissa.
_LOW_BITS = 16
_HIGH_BITS_MASK = -(1 << _LOW_BITS)  # 0xFFFF0000 as a signed int32


def stochastic_round_to_bf16(source: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`source` (float32) rounded to bfloat16 up or down at random, with the probability of rounding up
    equal to how far `source` lies towards the next bf16 value: unbiased, E[result] = source.

    A float32 whose low 16 bits are zero is exactly a bf16; adding 16 uniform random bits to the bit
    pattern carries into the kept bits with exactly that probability (sign-magnitude: for negative numbers
    it rounds the magnitude, so the value, the same way). 2kpr's method, as kohya's adafactor_fused uses it."""
    if source.dtype != torch.float32:
        raise ValueError(f"stochastic rounding reads float32, got {source.dtype}")
    noise = torch.randint(0, 1 << _LOW_BITS, source.shape, dtype=torch.int32, device=source.device, generator=generator)
    bits = noise.add_(source.view(torch.int32)).bitwise_and_(_HIGH_BITS_MASK)
    return bits.view(torch.float32).to(torch.bfloat16)


class FusedBackwardAdafactor(Adafactor):
    """transformers' Adafactor, stepped per parameter inside the backward pass.

    Registers a post-accumulate-grad hook on every parameter that requires a gradient; the hook clips
    that gradient (per parameter), steps that parameter with `Adafactor.step`, and frees its gradient.
    `step()` afterwards only checks that nothing was left unstepped, so a loop written for an ordinary
    optimizer (backward, step, zero_grad) runs unchanged. State and schedule are the ordinary optimizer's
    (`state_dict`, `param_groups`), so checkpoints and LambdaLR work as for any optimizer; the factored
    second moments stay float32 through `load_state_dict` (torch would cast them to the weights' bf16)."""

    # torch.optim.Optimizer's (mypy does not follow torch); `_adafactor_step` swaps it for one parameter's group.
    param_groups: list[dict[str, Any]]

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        lr: float,
        *,
        seed: int,
        max_grad_norm: float | None = None,
        stochastic_rounding: bool = True,
        **hyperparameters: Any,
    ) -> None:
        super().__init__(list(parameters), lr=lr, **hyperparameters)
        self.seed = seed
        self.max_grad_norm = max_grad_norm
        self.stochastic_rounding = stochastic_rounding
        self._index: dict[torch.nn.Parameter, int] = {}
        # The group's position, not the dict: load_state_dict replaces the group dicts a schedule then sets.
        self._group: dict[torch.nn.Parameter, int] = {}
        self._stepped_this_pass: set[int] = set()
        self._generators: dict[torch.device, torch.Generator] = {}
        for position, group in enumerate(self.param_groups):
            for parameter in group["params"]:
                self._index[parameter] = len(self._index)
                self._group[parameter] = position
                if parameter.requires_grad:
                    parameter.register_post_accumulate_grad_hook(_weak_hook(self.step_parameter))

    @torch.no_grad()
    def step_parameter(self, parameter: torch.nn.Parameter) -> None:
        """Clip, step and free one parameter's gradient (the hook, called by autograd)."""
        if parameter.grad is None:
            return
        index = self._index[parameter]
        if index in self._stepped_this_pass:
            # Two accumulations in one pass (a weight shared between separately checkpointed segments) would
            # step it twice on partial gradients.
            raise RuntimeError(
                f"parameter {index} received its gradient twice in one backward pass; the fused pass cannot step it"
            )
        self._stepped_this_pass.add(index)
        if parameter.dtype == torch.float32:
            working = parameter
        else:
            working = parameter.detach().float()
            working.grad = parameter.grad.float()
            parameter.grad = None
        if self.max_grad_norm:
            torch.nn.utils.clip_grad_norm_([working], self.max_grad_norm)
        self._adafactor_step(parameter, working)
        if working is not parameter:
            parameter.copy_(self._rounded(parameter, working))
        parameter.grad = None

    def _adafactor_step(self, parameter: torch.nn.Parameter, working: torch.Tensor) -> None:
        """transformers' `Adafactor.step` on `working` (the parameter itself, or its fp32 copy carrying the
        gradient) with the parameter's group settings and state, and nothing else in `param_groups`."""
        if working is not parameter:
            self.state[working] = self.state.pop(parameter, {})
        state = self.state[working]
        for key, value in state.items():
            if torch.is_tensor(value) and value.device != working.device:
                # Loaded where the parameter was then (a block-swapped one's host copy); stepped on the device.
                state[key] = value.to(working.device)
        saved_groups = self.param_groups
        self.param_groups = [{**saved_groups[self._group[parameter]], "params": [working]}]
        try:
            Adafactor.step(self)
        finally:
            self.param_groups = saved_groups
            if working is not parameter:
                self.state[parameter] = self.state.pop(working)

    def _rounded(self, parameter: torch.nn.Parameter, working: torch.Tensor) -> torch.Tensor:
        if not self.stochastic_rounding or parameter.dtype != torch.bfloat16:
            return working.to(parameter.dtype)
        generator = self._generators.get(working.device)
        if generator is None:
            generator = self._generators[working.device] = torch.Generator(device=working.device)
        # A pure function of (seed, parameter, its step count): a resumed run draws what the uninterrupted one did.
        generator.manual_seed(
            seed_for(self.seed, "stochastic_rounding", self._index[parameter], self.state[parameter]["step"])
        )
        return stochastic_round_to_bf16(working, generator)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The end of a backward pass: every gradient was consumed by its hook."""
        loss = closure() if closure is not None else None
        left = [self._index[parameter] for parameter in self._index if parameter.grad is not None]
        if left:
            raise RuntimeError(f"{len(left)} parameters kept a gradient the fused pass did not step (e.g. {left[:3]})")
        self._stepped_this_pass.clear()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch casts floating-point state to each parameter's dtype (bf16): restore the saved float32.
        for parameter, index in self._index.items():
            for key, value in state_dict["state"].get(index, {}).items():
                if torch.is_tensor(value) and value.is_floating_point():
                    self.state[parameter][key] = value.to(device=parameter.device, dtype=torch.float32)


def _weak_hook(method: Any) -> Any:
    """A hook that calls `method` while its optimizer lives: the parameters then do not keep the optimizer
    (and its state) alive once the trainer lets go of it (metrics.alive_at_export)."""
    reference = weakref.WeakMethod(method)

    def hook(parameter: torch.nn.Parameter) -> None:
        bound = reference()
        if bound is not None:
            bound(parameter)

    return hook


def check_fused_backward_pass(
    config: TrainerConfig, deepspeed_config: dict[str, Any] | None, num_processes: int
) -> None:
    """`invalid_config` for what the fused pass cannot do, before any model is loaded."""
    if not config.memory.fused_backward_pass:
        return
    problems = []
    if config.training_type != "full":
        problems.append(f"it trains every weight (training_type 'full'), not {config.training_type!r}")
    if normalise_optimizer_name(config.optimisation.optimizer) != "adafactor":
        problems.append(f"it steps with Adafactor, not {config.optimisation.optimizer!r}")
    if config.memory.mixed_precision != "bf16":
        problems.append(
            f"it keeps the weights in bf16, so mixed_precision must be 'bf16', not {config.memory.mixed_precision!r}"
        )
    if config.optimisation.gradient_accumulation_steps != 1:
        problems.append(
            f"gradient_accumulation_steps must be 1, not {config.optimisation.gradient_accumulation_steps}: each weight is stepped as "
            "soon as its gradient exists, and accumulating would need the gradient buffer the pass exists to avoid"
        )
    if deepspeed_config is not None:
        problems.append("it runs without DeepSpeed (DeepSpeed's engine owns the gradients and the step)")
    if num_processes != 1:
        problems.append(
            f"it runs in one process, not {num_processes}: data parallelism reduces gradients after the hooks step them"
        )
    if problems:
        raise TrainerFailure("invalid_config", "fused_backward_pass: " + "; ".join(problems))


def build_fused_adafactor(parameters: Iterable[torch.nn.Parameter], config: TrainerConfig) -> FusedBackwardAdafactor:
    """The optimizer with kohya's FLUX Adafactor settings (OPTIMIZER_HYPERPARAMETERS['adafactor'])."""
    # transformers' Adafactor keywords (the table types its values only as `object`).
    hyperparameters: dict[str, Any] = dict(OPTIMIZER_HYPERPARAMETERS["adafactor"])
    return FusedBackwardAdafactor(
        parameters,
        lr=config.optimisation.learning_rate,
        seed=config.optimisation.seed,
        max_grad_norm=config.optimisation.max_grad_norm,
        **hyperparameters,
    )
