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

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from mixprec.errors import PolicyError
from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipe import Fp8Recipe
from mixprec.fp8.state import Fp8State, update_history
from mixprec.policy.modules import ModuleDecision
from mixprec.policy.policy import Policy

__all__ = [
    "NoFp8LayerError", "check_converts", "fp8_layers", "fp8_update", "no_layer_message",
    "to_fp8",
]  # fmt: skip


class NoFp8LayerError(PolicyError):
    """FP8 was asked for, and the policy's rules select no layer of the model (the message
    lists every linear layer with the reason it was refused)."""


def no_layer_message(model: nn.Module, recipe: Fp8Recipe, decisions: Iterable[ModuleDecision],
                     policy: Policy) -> str:  # fmt: skip
    """Why FP8 with `recipe` converts no layer of `model`, and what to change."""
    decisions = list(decisions)
    what = f"FP8 (recipe {recipe.name!r}) converts no layer of {type(model).__name__}"
    if not decisions:
        return (f"{what}: it has no nn.Linear layer (FP8 runs linear layers only). Drop fp8=... "
                f"for this model.")  # fmt: skip
    rules = "+".join(map(str, policy.modules)) or "auto"
    lines = [f"{what}: the FP8 rules (fp8={rules}) refused every linear layer:"]
    lines += [f"  {d}" for d in decisions]
    lines.append(
        "Select layers with a policy rule (policy='fp8=all', or a glob: 'fp8=blocks.*.mlp.*'), "
        "make their in/out features multiples of 16, or drop fp8=... to train without FP8."
    )
    return "\n".join(lines)


def check_converts(models: Sequence[nn.Module], recipe: Fp8Recipe, policy: Policy) -> None:
    """Raise `NoFp8LayerError` when FP8 would convert no layer of any of `models` (layers
    already converted count). Reads the models only."""
    plans = [policy.plan_fp8(m) for m in models]
    if any(d.fp8 for plan in plans for d in plan) or any(fp8_layers(m) for m in models):
        return
    raise NoFp8LayerError(no_layer_message(models[0], recipe, plans[0], policy))


def to_fp8(
    model: nn.Module,
    recipe: Fp8Recipe | str = "tensorwise",
    policy: Policy | str | None = None,
    *,
    amax_group: object = None,
) -> nn.Module:
    """Run the linear layers `policy` selects in FP8, following `recipe`. In place.

    Args:
        model: the model (its weights on the device it trains on).
        recipe: an `Fp8Recipe` or a name: ``'tensorwise'``, ``'delayed'``, ``'rowwise'``.
        policy: a `mixprec.Policy` (or string) whose FP8 module rules select the layers
            (``'fp8=auto+!head'``); without rules, ``fp8=auto``: every linear layer with sizes
            multiple of 16 except the first and the last. ``policy.plan_fp8(model)`` previews it.
        amax_group: a ``torch.distributed`` process group whose ranks agree on every amax
            before it enters a history (`fp8_update` all-reduces them, MAX: one asynchronous
            all-reduce per step for the whole model). Needed where ranks quantise parts of one
            tensor (tensor or sequence parallel layouts; `mixprec.fully_shard` sets it for
            FSDP2's FP8 all-gather); None: each rank keeps its own histories (data parallel).

    Returns:
        `model`, with the selected ``nn.Linear`` submodules replaced by `Fp8Linear` (the model
        itself when it is one ``nn.Linear``: then the new module is returned).

    Raises:
        PolicyError: an unknown recipe, a bad policy, or a layer already converted with another
            recipe (convert a fresh model to change the recipe).
        NoFp8LayerError: the rules select no layer (the message lists each linear layer and
            why it was refused).
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
        raise NoFp8LayerError(no_layer_message(model, recipe, decisions, policy))
    made: dict[int, Fp8Linear] = {}  # one replacement per layer, however many parents hold it
    if "" in swaps:  # the model itself is the one linear layer
        new = _swap(model, swaps[""], recipe, made)
        new.fp8_amax_group = amax_group
        return new
    # named_modules() names a shared module once, by its first path: the plan's name for it.
    names = {id(m): n for n, m in model.named_modules()}
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            decision = None if child is None else swaps.get(names.get(id(child), ""))
            if decision is not None and type(child) is not Fp8Linear:
                parent._modules[child_name] = _swap(child, decision, recipe, made)
    for layer in made.values():
        layer.fp8_amax_group = amax_group
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

    No host sync: tensor ops only, so the update is recorded in a captured CUDA graph. Layers
    with an ``amax_group`` (`to_fp8`) first agree on their amaxes across that group: one
    all-reduce (MAX, asynchronous; waited on by the device, not the host, on NCCL) for all of
    them.
    """
    if isinstance(model_or_layers, nn.Module):
        layers = [m for _, m in fp8_layers(model_or_layers)]
    else:
        layers = list(model_or_layers)
    groups: dict[tuple[Fp8Recipe, torch.device, int], list[Fp8Linear]] = {}
    for layer in layers:
        key = (layer.fp8_recipe, layer.fp8_scale.device, id(layer.fp8_amax_group))
        groups.setdefault(key, []).append(layer)
    with torch.no_grad():
        pendings = {key: _pending(group) for key, group in groups.items()}
        _agree(groups, pendings)
        for key, group in groups.items():
            _update_group(group, key[0], pendings[key], skipped)


def _pending(group: list[Fp8Linear]) -> torch.Tensor:
    """(L, 3): this step's largest amax of each layer's input, weight and gradient."""
    fwd = torch.stack([m.fp8_fwd[:2] for m in group])
    grad = torch.stack([m.pending_grad_amax() for m in group])
    return torch.cat([fwd, grad.unsqueeze(1)], dim=1)


def _agree(groups: dict[tuple, list[Fp8Linear]], pendings: dict[tuple, torch.Tensor]) -> None:
    """MAX-all-reduce the pending amaxes of layers with an amax group: one call per group."""
    by_group: dict[int, list[tuple]] = {}
    for key, group in groups.items():
        if group[0].fp8_amax_group is not None:
            by_group.setdefault(key[2], []).append(key)
    if not by_group:
        return
    import torch.distributed as dist

    for keys in by_group.values():
        flat = torch.cat([pendings[k].reshape(-1) for k in keys])
        work = dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=groups[keys[0]][0].fp8_amax_group,
                               async_op=True)  # fmt: skip
        work.wait()  # NCCL: the current stream waits for it; the host does not
        for k, part in zip(keys, flat.split([pendings[k].numel() for k in keys]), strict=True):
            pendings[k] = part.view_as(pendings[k])


def _valid(t: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(t) & (t > 0)


def _update_group(group: list[Fp8Linear], recipe: Fp8Recipe, pending: torch.Tensor,
                  skipped: torch.Tensor | None) -> None:  # fmt: skip
    histories = [m.fp8_history for m in group]
    scales = [m.fp8_scale for m in group]
    fwds = [m.fp8_fwd for m in group]
    bwds = [m.fp8_bwd for m in group]
    flag = None if skipped is None else skipped.to(pending.device)
    new = update_history(Fp8State(torch.stack(histories), torch.stack(scales)), pending, recipe,
                         flag)  # fmt: skip
    torch._foreach_copy_(histories, list(new.history.unbind(0)))
    torch._foreach_copy_(scales, list(new.scale.unbind(0)))
    fwd, bwd = torch.stack(fwds), torch.stack(bwds)
    if recipe.true_delayed:
        # The scales the next casts take as they are: the delayed ones, or where an operand has
        # no history yet, the last ones used (1 if there are none: the bytes then say more).
        last = torch.cat([fwd[:, 2:], bwd[:, 1:]], dim=1)
        fallback = torch.where(_valid(last), last, torch.ones_like(last))
        nexts = torch.where(_valid(new.scale), new.scale, fallback)
        torch._foreach_copy_([m.fp8_next for m in group], list(nexts.unbind(0)))
        for m in group:
            m.fp8_ready = True
    # Clear the pending amaxes (they may be inf/NaN: no multiply); keep the last-used scales.
    fwd = torch.cat([torch.zeros_like(fwd[:, :2]), fwd[:, 2:]], dim=1)
    torch._foreach_copy_(fwds, list(fwd.unbind(0)))
    bwd = torch.cat([torch.zeros_like(bwd[:, :1]), bwd[:, 1:]], dim=1)
    torch._foreach_copy_(bwds, list(bwd.unbind(0)))
    for m in group:
        m.clear_pending()
