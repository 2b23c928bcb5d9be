"""mixprec in an Accelerate loop: `AmpAccelerator`, an ``Accelerator`` with mixprec's precision.

    accelerator = AmpAccelerator(Accelerator(), opt_level="O1", dtype="fp16")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()             # scaled, skipped on the device on overflow, scale updated
        scheduler.step()             # holds still on a skipped step (SkipAwareLR)
        optimizer.zero_grad()

Accelerate has no public hook for another scaler or autocast (``GradScalerKwargs`` and
``AutocastKwargs`` only tune torch's own), and its maintainers advise against replacing
``accelerator.scaler``. So the Accelerator is created with ``mixed_precision="no"`` and wrapped,
by composition: `AmpAccelerator` answers the precision methods itself (``prepare*``,
``backward``, ``unscale_gradients``, ``clip_grad_norm_``, ``clip_grad_value_``, ``autocast``,
``optimizer_step_was_skipped``, ``scaler``) and hands every other attribute to the wrapped
Accelerator (``accumulate``, ``gather``, ``save_state``, ``print``, ...). Neither Accelerate nor
the objects it returns are patched.

What ``prepare`` does on top of Accelerate's: models get the opt level (O1: a forward hook runs
the forward under ``mixprec.autocast`` and returns fp32 outputs, as Accelerate does for its own
autocast; O2/O3: the model is cast, with fp32 masters for O2); optimizers become `AmpOptimizer`s
before Accelerate wraps them (their state dict carries the scaler and the masters, so
``save_state``/``load_state`` resume both); LR schedulers are wrapped in `mixprec.SkipAwareLR`,
because Accelerate decides "skipped" from a host flag that a device-side skip never sets.

Costs: none per step beyond the opt level's; ``optimizer_step_was_skipped`` reads the device
(one sync per read); SkipAwareLR on an optimizer that reads its lr on the host (non-fused)
reads the skip flag once per step (``fused=True`` avoids it).

Supported: one process or DDP (``MULTI_GPU``/``MULTI_CPU``); DeepSpeed, FSDP, Megatron-LM and
XLA bring their own precision handling and are refused. Install with ``pip install -e '.[hf]'``
in the checkout.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.integrations import require
from mixprec.integrations.engine import AmpConfig, AmpEngine, IntegrationError, unwrap_optimizer

require("accelerate", "hf", "mixprec.integrations.accelerate")

import accelerate  # noqa: E402

from mixprec.eager.autocast import autocast  # noqa: E402
from mixprec.levels.optimizer import AmpOptimizer  # noqa: E402
from mixprec.scaling.schedule import SkipAwareLR  # noqa: E402

__all__ = ["AmpAccelerator"]

_SUPPORTED = ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
              "MULTI_MUSA", "MULTI_HPU")  # fmt: skip
_OWN = ("_accelerator", "_engine", "config")


def _own_precision_message(mode: str, created_here: bool) -> str:
    """Why an Accelerator runs its own mixed precision, and how to get one that does not.

    Accelerate keeps one state per process (``AcceleratorState``): the first Accelerator created
    in a process fixes its mixed precision (from its argument, or ``ACCELERATE_MIXED_PRECISION``,
    which ``accelerate launch --mixed_precision`` and ``accelerate config`` set), and a later
    ``Accelerator()`` given no ``mixed_precision`` inherits it. So the Accelerator's value does not
    say what its creator passed; the message names each source that can have set it.
    """
    env = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if env != "no":
        source = (f"ACCELERATE_MIXED_PRECISION={env!r} is set in this process's environment "
                  f"(accelerate launch --mixed_precision or accelerate config set it)")  # fmt: skip
    elif created_here:
        source = ("an earlier Accelerator in this process set it: Accelerate keeps one state per "
                  "process (AcceleratorState), and the Accelerator created here without "
                  "mixed_precision inherited it")  # fmt: skip
    else:
        source = ("either it was given that, or an earlier Accelerator in this process was: "
                  "Accelerate keeps one state per process (AcceleratorState), and an "
                  "Accelerator() created later without mixed_precision inherits it")  # fmt: skip
    return (
        f"the Accelerator runs mixed_precision={mode!r} ({source}), which would run "
        f"torch.autocast and torch's GradScaler under mixprec's. Wrap an Accelerator whose "
        f"precision is 'no': create it with mixed_precision='no' (the default) as the first "
        f"Accelerator of a fresh process (Accelerate cannot change the precision of a process "
        f"whose state is set), launched without --mixed_precision, and choose the precision "
        f"here: AmpAccelerator(Accelerator(), dtype='fp16')."
    )


class AmpAccelerator:
    """An ``accelerate.Accelerator`` that trains with mixprec's opt levels and scaler.

    Args:
        accelerator: the Accelerator to wrap, created with ``mixed_precision="no"`` (default).
        opt_level: ``'O0'`` ... ``'O3'`` (default ``'O1'``).
        dtype: ``'fp16'`` or ``'bf16'`` (default fp16 on CUDA, bf16 elsewhere).
        policy: a `mixprec.Policy` or its string form, for O1's autocast (see `AmpConfig`).
        scaler: `mixprec.GradScaler` keyword arguments, used when the level scales (fp16).
        options: ``mixprec.initialize``'s option overrides (``keep_batchnorm_fp32``, ...).
        hold_schedule_on_skip: hold LR schedulers still on skipped steps (default True).
        config: an `AmpConfig` instead of those arguments.

    Raises:
        IntegrationError: the Accelerator does its own mixed precision, or runs under
            DeepSpeed/FSDP/Megatron-LM/XLA (the message says what to change).
    """

    def __init__(
        self,
        accelerator: Any = None,
        opt_level: str = "O1",
        dtype: str | torch.dtype | None = None,
        *,
        policy: Any = None,
        scaler: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        hold_schedule_on_skip: bool | None = None,
        config: AmpConfig | None = None,
    ) -> None:
        created_here = accelerator is None
        if created_here:
            accelerator = accelerate.Accelerator()
        if isinstance(accelerator, AmpAccelerator):
            raise IntegrationError("this Accelerator is an AmpAccelerator already; wrap it once.")
        if not isinstance(accelerator, accelerate.Accelerator):
            raise IntegrationError(
                f"AmpAccelerator wraps an accelerate.Accelerator, got {type(accelerator).__name__}."
            )
        if str(accelerator.mixed_precision) != "no":
            raise IntegrationError(_own_precision_message(str(accelerator.mixed_precision),
                                                          created_here))  # fmt: skip
        kind = accelerator.distributed_type
        if getattr(kind, "name", str(kind)) not in _SUPPORTED:
            raise IntegrationError(
                f"AmpAccelerator supports one process and DDP; this Accelerator runs "
                f"{kind}, which handles precision itself (DeepSpeed's fp16/bf16 config, FSDP's "
                f"mixed_precision_policy). Use that framework's precision settings instead."
            )
        if config is None:
            fields = {"policy": policy, "scaler": scaler, "options": options,
                      "hold_schedule_on_skip": hold_schedule_on_skip}  # fmt: skip
            config = AmpConfig(opt_level=opt_level, dtype=dtype,
                               **{k: v for k, v in fields.items() if v is not None})  # fmt: skip
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "_engine", AmpEngine(config, accelerator.device.type,
                                                      outputs_fp32=True))  # fmt: skip

    # ------------------------------------------------------------------ delegation

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._accelerator, name, value)

    def __repr__(self) -> str:
        return f"AmpAccelerator({self._engine!r}, device={self._accelerator.device})"

    @property
    def accelerator(self) -> Any:
        """The wrapped ``accelerate.Accelerator``."""
        return self._accelerator

    @property
    def engine(self) -> AmpEngine:
        """The opt level at work (`mixprec.integrations.engine.AmpEngine`)."""
        return self._engine

    @property
    def scaler(self) -> Any:
        """The `mixprec.GradScaler` (None when the level does not scale: bf16, O3)."""
        return self._engine.scaler

    # ------------------------------------------------------------------ prepare

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's ``prepare``, with the opt level applied (see the module docstring).

        Models are converted before optimizers are wrapped (O2 takes its masters from the fp32
        weights), and schedulers last, as Accelerate orders them.
        """
        if device_placement is None:
            device_placement = [None] * len(args)
        out = list(args)
        order = sorted(range(len(args)), key=lambda i: _rank(args[i]))
        for i in order:
            out[i] = self._prepare_one(args[i], device_placement[i])
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_one(self, obj: Any, placement: bool | None) -> Any:
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=placement)
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            return self.prepare_scheduler(obj)
        return self._accelerator.prepare(obj, device_placement=[placement])

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:  # fmt: skip
        """Apply the opt level to `model`, then Accelerate's ``prepare_model``."""
        self._engine.convert_module(model)
        return self._accelerator.prepare_model(model, device_placement=device_placement,
                                               evaluation_mode=evaluation_mode)  # fmt: skip

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> Any:  # fmt: skip
        """Wrap `optimizer` as an `AmpOptimizer` (O2: over fp32 masters), then Accelerate's."""
        amp = self._engine.wrap_optimizer(unwrap_optimizer(optimizer))
        return self._accelerator.prepare_optimizer(amp, device_placement=device_placement)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """Wrap `scheduler` in `mixprec.SkipAwareLR` (holds still on skipped steps), then
        Accelerate's ``prepare_scheduler``."""
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and not isinstance(
            scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
        ):
            amp = self._amp_of(scheduler.optimizer)
            if amp is not None:
                rebind = amp.optimizer is not unwrap_optimizer(scheduler.optimizer)
                hold = self._engine.scaler if self.config.hold_schedule_on_skip else None
                if hold is not None or rebind:
                    scheduler = SkipAwareLR(scheduler, hold, optimizer=amp)
        return self._accelerator.prepare_scheduler(scheduler)

    def _amp_of(self, optimizer: Any) -> AmpOptimizer | None:
        return self._engine.amp_for(optimizer)

    # ------------------------------------------------------------------ the step

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's gradient-accumulation division, then the scaled backward (no sync)."""
        loss = loss / self._accelerator.gradient_accumulation_steps
        self._engine.scale(loss).backward(**kwargs)
        self._engine.after_backward()

    def _optimizers(self, optimizer: Any) -> list[Any]:
        if optimizer is None:
            return list(self._accelerator._optimizers)
        return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Divide the gradients by the loss scale, once per step (no sync)."""
        for opt in self._optimizers(optimizer):
            self._engine.unscale_(opt)

    def _main(self, parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        self.unscale_gradients()
        return [self._engine.master_of(p) for p in parameters]

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:  # fmt: skip
        """Unscale, then clip the gradients of what is stepped (O2: the fp32 masters)."""
        return torch.nn.utils.clip_grad_norm_(self._main(parameters), max_norm,
                                              norm_type=norm_type)  # fmt: skip

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Unscale, then clip gradient values of what is stepped (O2: the fp32 masters)."""
        torch.nn.utils.clip_grad_value_(self._main(parameters), clip_value)

    def autocast(self, autocast_handler: Any = None) -> Any:
        """A ``mixprec.autocast`` region (O1), for code outside the model's forward.

        `autocast_handler` (an ``accelerate.utils.AutocastKwargs``; default: the Accelerator's
        own, from ``kwargs_handlers``) is honoured as Accelerate does: ``enabled=False`` opens a
        disabled region, which is how Accelerate documents reverting a block to fp32 inside
        the model's autocast, and ``cache_enabled`` is passed on. At O2/O3 there is no region
        (the model is cast), so nothing changes."""
        handler = autocast_handler
        if handler is None:
            handler = self._accelerator.autocast_handler
        kwargs = handler.to_kwargs() if hasattr(handler, "to_kwargs") else dict(handler or {})
        opts = self._engine.options
        if not kwargs.get("enabled", True) and opts.patch_torch_functions:
            return autocast(opts.device_type, enabled=False)
        return self._engine.autocast(cache_enabled=kwargs.get("cache_enabled"))

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last step overflowed and was skipped. One host-device sync per read."""
        return self._engine.last_step_skipped


def _rank(obj: Any) -> int:
    # Accelerate's order: data, models and optimizers first, schedulers last; models before
    # optimizers here, because O2 takes the masters when a model is converted.
    if isinstance(obj, torch.nn.Module):
        return 0
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return 2
    return 1
