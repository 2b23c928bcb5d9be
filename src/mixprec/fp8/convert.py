"""`to_fp8` swaps the linear layers a policy selects for `Fp8Linear`; `fp8_update` advances them.

Why a module swap (and not a rule in the autocast engine): an FP8 layer owns state, three
scales and their amax histories, which must persist between steps, be checkpointed with the
model, move with ``model.to()`` and be captured by a CUDA graph. A module holds such state as
buffers, found by ``state_dict`` and by every tool that walks a model; an engine rule sees only
``F.linear(x, w, b)`` calls and would have to find a layer's state from its weight tensor, which
a compiled graph (where weights are graph inputs) does not preserve. The swap is composition:
the new module shares the old one's Parameter objects, so optimizers, tied weights and the
user's references stay valid, the model's ``state_dict`` keys for weights are unchanged, and
nothing of torch or of the user's classes is patched. The engine still sees every other op.

Cost of `fp8_update`: a fixed handful of kernels for the whole model (layers are stacked), no
host sync; it must run once per optimizer step for delayed scaling (``initialize``'s optimizer
and `mixprec.TrainStep` call it), and is harmless for dynamic recipes (it records the amaxes
the report shows).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mixprec.errors import PolicyError
from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipe import Fp8Recipe
from mixprec.fp8.state import Fp8State, update_history
from mixprec.policy.modules import ModuleDecision
from mixprec.policy.policy import Policy

__all__ = ["fp8_layers", "fp8_update", "to_fp8"]


def to_fp8(
    model: nn.Module,
    recipe: Fp8Recipe | str = "tensorwise",
    policy: Policy | str | None = None,
) -> nn.Module:
    """Run the linear layers `policy` selects in FP8, following `recipe`. In place.

    Args:
        model: the model (its weights on the device it trains on).
        recipe: an `Fp8Recipe` or a name: ``'tensorwise'``, ``'delayed'``, ``'rowwise'``.
        policy: a `mixprec.Policy` (or string) whose FP8 module rules select the layers
            (``'fp8=auto+!head'``); without rules, ``fp8=auto``: every linear layer with sizes
            multiple of 16 except the first and the last. ``policy.plan_fp8(model)`` previews it.

    Returns:
        `model`, with the selected ``nn.Linear`` submodules replaced by `Fp8Linear` (the model
        itself when it is one ``nn.Linear``: then the new module is returned).

    Raises:
        PolicyError: an unknown recipe, a bad policy, or a layer already converted with another
            recipe (convert a fresh model to change the recipe).
    """
    recipe = Fp8Recipe.named(recipe)
    if isinstance(policy, str):
        policy = Policy.from_string(policy)
    if policy is None:
        policy = Policy()
    if not isinstance(policy, Policy):
        raise PolicyError(f"policy must be a mixprec.Policy or its string form, got {policy!r}.")
    if not isinstance(model, nn.Module):
        raise PolicyError(f"to_fp8 needs an nn.Module, got {type(model).__name__}.")
    _check_device(model, recipe)
    decisions = policy.plan_fp8(model)
    for name, layer in fp8_layers(model):
        if layer.fp8_recipe != recipe:
            raise PolicyError(
                f"layer {name!r} already runs FP8 recipe {layer.fp8_recipe.summary()}; "
                f"to_fp8 was asked for {recipe.summary()}. Convert a fresh model instead."
            )
    swaps = {d.module: d for d in decisions if d.fp8}
    if not swaps:
        return model
    made: dict[int, Fp8Linear] = {}  # one replacement per layer, however many parents hold it
    if "" in swaps:  # the model itself is the one linear layer
        return _swap(model, swaps[""], recipe, made)
    # named_modules() names a shared module once, by its first path: the plan's name for it.
    names = {id(m): n for n, m in model.named_modules()}
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            decision = None if child is None else swaps.get(names.get(id(child), ""))
            if decision is not None and type(child) is not Fp8Linear:
                parent._modules[child_name] = _swap(child, decision, recipe, made)
    return model


def _check_device(model: nn.Module, recipe: Fp8Recipe) -> None:
    from mixprec._compat import scaled_mm_available

    for p in model.parameters():
        if p.device.type == "cuda" and not recipe.emulate and not scaled_mm_available(p.device):
            name = torch.cuda.get_device_name(p.device)
            raise PolicyError(
                f"FP8 matmuls need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                f"{name} is {torch.cuda.get_device_capability(p.device)}. Train in bf16 without "
                f"fp8, or pass recipe.replace(emulate=True) to check FP8 numerics (slowly)."
            )
        return


def _swap(layer: nn.Module, decision: ModuleDecision, recipe: Fp8Recipe,
          made: dict[int, Fp8Linear]) -> Fp8Linear:  # fmt: skip
    assert isinstance(layer, nn.Linear)
    new = made.get(id(layer))
    if new is None:
        new = made[id(layer)] = Fp8Linear.from_linear(layer, recipe, decision.reason)
    return new


def fp8_layers(model: nn.Module) -> list[tuple[str, Fp8Linear]]:
    """The `Fp8Linear` layers of `model`, with their qualified names, in registration order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]


def fp8_update(
    model_or_layers: nn.Module | Iterable[Fp8Linear], skipped: torch.Tensor | None = None
) -> None:
    """Fold this step's amaxes into the FP8 histories and scales; call once per optimizer step.

    Args:
        model_or_layers: a model (its `Fp8Linear` layers are updated) or the layers.
        skipped: the optimizer step's skip flag, a 0-dim device tensor (non-zero: the step was
            skipped, and histories and scales stay exactly as they were), e.g.
            ``scaler.step_skipped(optimizer)``. None: the step ran.

    No host sync: tensor ops only, so the update is recorded in a captured CUDA graph.
    """
    if isinstance(model_or_layers, nn.Module):
        layers = [m for _, m in fp8_layers(model_or_layers)]
    else:
        layers = list(model_or_layers)
    groups: dict[tuple[Fp8Recipe, torch.device], list[Fp8Linear]] = {}
    for layer in layers:
        groups.setdefault((layer.fp8_recipe, layer.fp8_scale.device), []).append(layer)
    with torch.no_grad():
        for (recipe, _), group in groups.items():
            _update_group(group, recipe, skipped)


def _update_group(group: list[Fp8Linear], recipe: Fp8Recipe, skipped: torch.Tensor | None) -> None:
    histories = [m.fp8_history for m in group]
    scales = [m.fp8_scale for m in group]
    fwds = [m.fp8_fwd for m in group]
    bwds = [m.fp8_bwd for m in group]
    fwd = torch.stack(fwds)
    grad = torch.stack([m.pending_grad_amax() for m in group])
    pending = torch.cat([fwd[:, :2], grad.unsqueeze(1)], dim=1)
    flag = None if skipped is None else skipped.to(pending.device)
    new = update_history(Fp8State(torch.stack(histories), torch.stack(scales)), pending, recipe,
                         flag)  # fmt: skip
    torch._foreach_copy_(histories, list(new.history.unbind(0)))
    torch._foreach_copy_(scales, list(new.scale.unbind(0)))
    # Clear the pending amaxes (they may be inf/NaN: no multiply); keep the last-used scales.
    fwd = torch.cat([torch.zeros_like(fwd[:, :2]), fwd[:, 2:]], dim=1)
    torch._foreach_copy_(fwds, list(fwd.unbind(0)))
    bwd = torch.stack(bwds)
    bwd = torch.cat([torch.zeros_like(bwd[:, :1]), bwd[:, 1:]], dim=1)
    torch._foreach_copy_(bwds, list(bwd.unbind(0)))
    for m in group:
        m.clear_pending()
