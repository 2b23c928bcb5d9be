"""What `GradScaler` needs from an optimizer, and torch's contracts for optimizers that scale.

torch.amp.GradScaler defines two ways for an optimizer to handle loss scaling itself, both
announced by the class attribute ``_step_supports_amp_scaling = True``:

- **attributes** (torch's fused optimizers, ``fused=True``): the scaler sets
  ``optimizer.grad_scale`` and ``optimizer.found_inf`` (0-dim tensors) for the duration of
  ``step()``; the optimizer unscales inside its kernel and skips the update where ``found_inf``
  is 1. A ``grad_scale`` the user set beforehand is *multiplied* by the loss scale, and torch
  deletes both attributes after the step; mixprec does the same.
- **keyword** (the older contract, still honoured by torch, which warns ``FutureWarning``):
  ``step(..., grad_scaler=scaler)``. The optimizer then does everything itself, typically with
  ``grad_scaler._check_inf_per_device(self)`` and ``grad_scaler._get_scale_async()`` (apex's and
  Transformer Engine's FusedAdam, ColossalAI's HybridAdam) or ``grad_scaler.unscale_(self)``.
  mixprec passes itself the same way and offers those methods with torch's meaning, so such
  optimizers see the scale and the overflow flags they expect. Their skips are as exact as the
  optimizer makes them: mixprec cannot check what it does not run.

Optimizers whose ``step()`` requires a closure (LBFGS) re-evaluate the loss inside the step,
where it can be neither scaled nor unscaled: they are refused with the reason.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

import torch

from mixprec.scaling.state import ScalerConfigError

if TYPE_CHECKING:
    from mixprec.scaling.scaler import GradScaler

__all__ = [
    "LEGACY_WARNING",
    "check_inf_per_device",
    "check_optimizer",
    "consumes_scale_attributes",
    "keyword_step",
    "needs_closure",
    "refuse_closure_optimizer",
    "takes_scaler_keyword",
]

#: The FutureWarning of the keyword contract (torch warns the same way, with its own words).
LEGACY_WARNING = (
    "{name}.step() takes a `grad_scaler` keyword argument and declares "
    "_step_supports_amp_scaling, so mixprec.GradScaler passes itself to it, as "
    "torch.amp.GradScaler does. torch deprecates this contract: an optimizer should read the "
    "`grad_scale` and `found_inf` tensors the scaler sets on it instead (as torch's fused "
    "optimizers do)."
)


def check_optimizer(optimizer: Any, method: str) -> None:
    """Raise a TypeError naming the slip if `optimizer` is not an optimizer.

    Cost: two attribute lookups (called on every ``unscale_``/``step``).
    """
    if hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None)):
        return
    what = type(optimizer).__name__
    if isinstance(optimizer, torch.nn.Module):
        hint = f"this is a model ({what}); pass the optimizer that steps its parameters"
    elif isinstance(optimizer, (list, tuple)):
        hint = f"call scaler.{method}(optimizer) once per optimizer"
    elif isinstance(optimizer, torch.Tensor):
        hint = "this is a tensor; pass the optimizer (the loss goes to scaler.scale(loss))"
    else:
        hint = "pass the torch.optim.Optimizer that steps the scaled gradients"
    raise TypeError(f"GradScaler.{method} expects an optimizer, got {what}: {hint}.")


def _step_parameters(optimizer: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(optimizer.step).parameters)
    except (TypeError, ValueError):  # a builtin or C step: no Python signature to read
        return {}


def needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS)."""
    param = _step_parameters(optimizer).get("closure")
    return param is not None and param.default is inspect.Parameter.empty


def refuse_closure_optimizer(optimizer: Any) -> None:
    """Raise `ScalerConfigError` if `optimizer` can only step with a closure."""
    if needs_closure(optimizer):
        name = type(optimizer).__name__
        raise ScalerConfigError(
            f"{name} cannot step under loss scaling: its step() requires a closure that "
            f"re-evaluates the loss inside the step, where the scaler can neither scale it nor "
            f"unscale its gradients. Train {name} without a GradScaler: in bf16 "
            f"(mixprec.autocast(device, dtype=torch.bfloat16) needs no scaling) or in fp32."
        )


def takes_scaler_keyword(optimizer: Any) -> bool:
    """The keyword contract: ``_step_supports_amp_scaling`` and ``step(grad_scaler=...)``."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    return "grad_scaler" in _step_parameters(optimizer)


def consumes_scale_attributes(optimizer: Any) -> bool:
    """The attribute contract: ``_step_supports_amp_scaling`` without the keyword (fused)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
        not takes_scaler_keyword(optimizer)
    )


def keyword_step(scaler: GradScaler, optimizer: Any, args: tuple, kwargs: dict) -> Any:
    """Step an optimizer of the keyword contract: it gets the scaler and does the rest itself.

    Whatever overflow it records on the scaler (``_check_inf_per_device``, ``unscale_``)
    counts for ``update()`` and for the scaler's skip flag, as under torch.
    """
    warnings.warn(LEGACY_WARNING.format(name=type(optimizer).__name__), FutureWarning,
                  stacklevel=3)  # fmt: skip
    scaler._state(optimizer)  # the optimizer's inf checks (if any) are recorded here
    result = optimizer.step(*args, **{**kwargs, "grad_scaler": scaler})
    state = scaler._state(optimizer)
    if state.pending is not None:
        state.pending.wait()
        state.pending = None
    if state.found_inf is not None:
        scaler._flag(optimizer, state.found_inf)
    return result


def check_inf_per_device(scaler: GradScaler, optimizer: Any) -> dict[Any, torch.Tensor]:
    """torch's ``_check_inf_per_device``: flag non-finite (still scaled) gradients per device.

    Records the flags as the optimizer's overflows for ``update()``; returns ``{device: 0-dim
    fp32 flag}``, 1.0 where that device saw a non-finite gradient (the fused kernels of apex
    and Transformer Engine skip on exactly 1.0). The stage does not change: torch's check does
    not count as ``unscale_``.
    """
    check_optimizer(optimizer, "_check_inf_per_device")
    per_device = {d: (f > 0).float() for d, f in scaler._check_only(optimizer).items()}
    state = scaler._state(optimizer)
    state.found_inf = scaler._combine(per_device)
    work = scaler._all_reduce(state.found_inf, optimizer)
    if work is not None:  # the optimizer uses the flags at once: every rank must agree first
        work.wait()
        per_device = {d: (state.found_inf > 0).float().to(d) for d in per_device}
    return per_device
