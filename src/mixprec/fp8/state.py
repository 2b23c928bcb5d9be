"""FP8 scaling state and its once-per-step update: a pure, sync-free function of device tensors.

Each FP8 layer keeps, on its device, for its three operands (input, weight, output gradient):

- ``history`` (3, H) fp32: the amax of the last H optimizer steps, newest first (0: not seen);
- ``scale`` (3,) fp32: the delayed scale for the next step, ``fmax / amax_h / 2**margin`` with
  ``amax_h`` the history's max (or its newest entry, ``amax_compute='most_recent'``); ``inf``
  until the history has an entry, which makes the first steps scale dynamically;
- ``pending`` (3,) fp32: the largest amax seen since the last update (forward and backward write
  it; several micro-batches accumulate their maximum).

`update_history` folds ``pending`` into the history and recomputes the scales, with
``torch.where`` only (as `mixprec.scaling.state.update_scale` does for the loss scale), so it
runs inside a captured CUDA graph and never reads a value back. The rule, per operand:

    skipped step (the loss scaler found inf/NaN):   history and scale unchanged
    pending is 0, inf or NaN (operand not seen, or not finite):   unchanged
    otherwise:   entering = min(pending, max_growth * max(history))   (if the history has one)
                 history = [entering, history[:-1]];   scale = fmax / amax_h / 2**margin

The bound on what enters keeps one outlier batch from dictating the scale for the whole
window (the recipe's ``max_growth``; ``inf`` records every amax as it is, as TE does).

A skipped step therefore leaves the FP8 state exactly as it leaves the optimizer's: a run that
skips a batch ends bitwise equal to one that never saw it. The pending amaxes are cleared either
way (the next step starts its own). Several layers with the same history length are updated
together, stacked: about ten kernels per step for the whole model, however many layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mixprec.fp8.numerics import scale_from_amax
from mixprec.fp8.recipe import Fp8Recipe, fp8_max

__all__ = ["Fp8State", "init_state", "operand_max", "update_history"]

#: Operand order in every per-layer state tensor.
OPERANDS = ("input", "weight", "grad")


class Fp8State(NamedTuple):
    """The committed delayed-scaling state of one layer (or of L layers, stacked: (L, 3, H))."""

    history: torch.Tensor
    scale: torch.Tensor


def operand_max(recipe: Fp8Recipe) -> tuple[float, float, float]:
    """fmax of each operand's format: e4m3 for input and weight, the recipe's for the gradient."""
    e4m3 = fp8_max(recipe.forward_dtype)
    return (e4m3, e4m3, fp8_max(recipe.grad_dtype))


def init_state(recipe: Fp8Recipe, device: torch.device | str | None = None) -> Fp8State:
    """An empty history (zeros) and ``inf`` scales (no delayed scale yet)."""
    length = recipe.history_len if recipe.delayed else 1
    return Fp8State(
        history=torch.zeros(3, length, dtype=torch.float32, device=device),
        scale=torch.full((3,), float("inf"), dtype=torch.float32, device=device),
    )


def update_history(
    state: Fp8State,
    pending: torch.Tensor,
    recipe: Fp8Recipe,
    skipped: torch.Tensor | None = None,
) -> Fp8State:
    """The state after one optimizer step whose amaxes were `pending`. Pure and sync-free.

    Args:
        state: ``history`` (..., 3, H) and ``scale`` (..., 3): one layer or several stacked.
        pending: (..., 3): this step's largest amax per operand (0 where not seen).
        recipe: the window's reduction, the margin and power-of-two rounding.
        skipped: a 0-dim tensor, non-zero when the optimizer step was skipped (None: it ran).

    Returns:
        New tensors (the inputs are not modified).
    """
    history, scale = state
    seen = torch.isfinite(pending) & (pending > 0)
    if skipped is not None:
        seen = seen & (skipped == 0)
    largest = history.amax(dim=-1)
    if recipe.max_growth != float("inf"):
        bound = torch.where(largest > 0, largest * recipe.max_growth, pending)
        pending = torch.minimum(pending, bound)
    rolled = torch.cat([pending.unsqueeze(-1), history[..., :-1]], dim=-1)
    new_history = torch.where(seen.unsqueeze(-1), rolled, history)
    most_recent = recipe.amax_compute == "most_recent"
    window = new_history[..., 0] if most_recent else new_history.amax(dim=-1)
    # fmax per operand, built with fills: a tensor made from host values would be a
    # host-to-device copy, which a CUDA graph cannot record.
    e4m3, _, grad = operand_max(recipe)
    fwd = torch.full_like(window[..., :2], e4m3)
    fmax = torch.cat([fwd, torch.full_like(window[..., 2:], grad)], dim=-1)
    fresh = scale_from_amax(window, fmax, recipe.power_of_two) / 2.0**recipe.margin
    new_scale = torch.where(seen & (window > 0), fresh, scale)
    return Fp8State(new_history, new_scale)
