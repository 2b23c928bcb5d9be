"""How ``initialize`` treats a model that DDP wraps or FSDP2 shards: accept, adapt, or refuse.

The order of wrapping decides what can work:

- **DDP** builds its gradient buckets, one dtype per bucket, for the parameters it sees when it
  is constructed. Levels that cast weights (O2, O3) must therefore run first: ``initialize``,
  then ``DistributedDataParallel(model)`` (Apex's order). O0 and O1 cast nothing and accept a DDP
  model in either order. When ``initialize`` is given the DDP wrapper, the loss scaler learns
  that DDP reduces every gradient and drops its own agreement all-reduce
  (`mixprec.distributed.agreement`).
- **FSDP2** fixes each unit's storage, gather and reduce dtypes in ``fully_shard``. A model
  sharded by `mixprec.fully_shard` already carries its level: ``initialize`` only adds the
  optimizer side (the scaler; no master copies). A model sharded by torch's ``fully_shard`` runs
  O0 and O1 as it is; O2 and O3 are refused with the way to get them.

Every refusal names the order that works.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec.distributed import agreement
from mixprec.distributed.fsdp import sharded_options, sharding_mismatch
from mixprec.distributed.topology import DistributedError, ddp_params, fsdp_modules, unwrap_ddp
from mixprec.dtypes import dtype_name
from mixprec.errors import UsageError
from mixprec.levels.model import amp_hooks
from mixprec.levels.presets import AmpOptions

__all__ = [
    "already_initialized_message",
    "casts_weights",
    "find_hooks",
    "model_kind",
    "refuse_lowmem_on_shards",
    "register_replicated",
]


def casts_weights(options: AmpOptions) -> bool:
    """Whether the level changes the dtype of the model's weights (O2, O3)."""
    return options.cast_model_type is not None and options.cast_model_type != torch.float32


def model_kind(
    model: nn.Module, options: AmpOptions, overrides: dict[str, Any], with_optimizer: bool
) -> str:
    """``'plain'``, ``'ddp'`` or ``'sharded'`` (prepared by mixprec.fully_shard); or raise.

    Raises:
        UsageError: the model was initialized already (the message gives the fix for the way
            it is wrapped now).
        DistributedError: the level cannot be applied to the model as it is wrapped (the message
            gives the order that works).
    """
    level = options.level.value
    casts = casts_weights(options)
    hooks = find_hooks(model)
    if hooks is not None and hooks.sharded is None:
        raise UsageError(already_initialized_message(model))
    if hooks is not None and hooks.optimized and with_optimizer:
        raise UsageError(
            f"{type(model).__name__} (sharded by mixprec.fully_shard) was already given to "
            f"mixprec.initialize with an optimizer; call initialize once per model."
        )
    if isinstance(model, DistributedDataParallel):
        if casts:
            raise DistributedError(
                f"mixprec.initialize(opt_level={level!r}) got a model already wrapped in "
                f"DistributedDataParallel. {level} casts the model's weights to "
                f"{dtype_name(options.dtype)} in place, and DDP has already built its gradient "
                f"buckets for the dtypes it saw, so initialize must come first: "
                f"`model, optimizer = mixprec.initialize(model, optimizer, opt_level={level!r})`, "
                f"then `model = DistributedDataParallel(model, ...)`. O0 and O1 cast no weights "
                f"and accept a DDP model in either order; mixprec.TrainStep(model, optimizer, "
                f"..., ddp=True) wraps in the right order for you."
            )
        return "ddp"
    sharded = sharded_options(model)
    if sharded is not None:
        _check_same_level(sharded, options, overrides)
        return "sharded"
    units = fsdp_modules(model)
    if units and casts:
        raise DistributedError(
            f"mixprec.initialize(opt_level={level!r}) got a model sharded with FSDP2 "
            f"(torch.distributed.fsdp.fully_shard) without mixprec's policies. Under FSDP2, "
            f"{level}'s {dtype_name(options.dtype)} weights are FSDP's own mixed precision "
            f"(its fp32 shards are the master weights), which is chosen when sharding: shard the "
            f"fp32 model with mixprec.fully_shard(model, opt_level={level!r}) instead of "
            f"fully_shard, build the optimizer over model.parameters(), then call "
            f"mixprec.initialize(model, optimizer, opt_level={level!r}). O0 and O1 run on a "
            f"model sharded with torch's fully_shard as it is."
        )
    return "plain"


def _check_same_level(sharded: AmpOptions, options: AmpOptions, overrides: dict[str, Any]) -> None:
    fixed = f"{sharded.level.value} ({dtype_name(sharded.dtype)})"
    name = sharding_mismatch(sharded, options, overrides)
    if name == "level":
        raise DistributedError(
            f"the model was sharded by mixprec.fully_shard at {fixed}, which fixed how its "
            f"weights are stored, gathered and reduced; initialize got "
            f"{options.level.value} ({dtype_name(options.dtype)}). Call "
            f"mixprec.initialize(model, optimizer, opt_level={sharded.level.value!r}, "
            f"dtype={dtype_name(sharded.dtype)!r}), or shard a fresh model at the level you want."
        )
    if name is not None:
        raise DistributedError(
            f"{name}={overrides[name]!r} differs from what mixprec.fully_shard applied to "
            f"this model ({name}={getattr(sharded, name)!r}); model-side options are fixed "
            f"when sharding. Drop {name} here, or pass it to mixprec.fully_shard."
        )


def already_initialized_message(model: nn.Module) -> str:
    """The error for a second ``initialize`` of `model`, with the fix for its wrapping."""
    name = type(unwrap_ddp(model)).__name__
    message = (
        f"{name} was already initialized by mixprec.initialize; initialize a model once (build "
        f"a fresh model to change the opt level)."
    )
    if fsdp_modules(model):
        message += (
            " It has been sharded with FSDP2 since, and FSDP2 needs the opt level while "
            "sharding (O2 after initialize fails in FSDP's first forward: 'FSDP expects uniform "
            "original parameter dtype'). Build the fp32 model afresh, call "
            "mixprec.fully_shard(model, opt_level=...) instead of initialize-then-fully_shard, "
            "build the optimizer over model.parameters(), then mixprec.initialize(model, "
            "optimizer, opt_level=...)."
        )
    elif isinstance(model, DistributedDataParallel):
        message += (
            " It is wrapped in DistributedDataParallel now: keep using the optimizer that first "
            "initialize call returned with this DDP model (initialize, then DDP, is the right "
            "order)."
        )
    return message


def find_hooks(model: nn.Module) -> Any:
    """The mixprec hooks on `model` or on the module a DDP wrapper holds (None if neither)."""
    return amp_hooks(model) or amp_hooks(unwrap_ddp(model))


def register_replicated(models: Sequence[nn.Module], optimizers: Sequence[Any]) -> None:
    """Tell the scaler that DDP reduces the gradients of `optimizers` where it can prove it.

    `optimizers` are `AmpOptimizer`s: in O2 the inner optimizer steps fp32 masters whose
    gradients are the (DDP-reduced) gradients of the low-precision weights, index for index.
    An optimizer is registered only if every tensor it steps is covered.
    """
    reduced: set[int] = set()
    for model in models:
        if isinstance(model, DistributedDataParallel):
            reduced.update(id(p) for p in ddp_params(model))
    if not reduced:
        return
    for opt in optimizers:
        pairs = zip(opt._low, opt._masters, strict=True)
        covered = {id(master) for low, master in pairs if id(low) in reduced}
        covered |= reduced
        stepped = [p for g in opt.optimizer.param_groups for p in g["params"]]
        if stepped and all(id(p) in covered for p in stepped):
            agreement.mark_replicated(opt.optimizer, stepped)


def refuse_lowmem_on_shards(optimizer: Any, entry: str) -> None:
    """Refuse a low-memory optimizer (`mixprec.LowMemAdamW`, ...) over sharded parameters.

    FSDP2's parameters (torch's ``fully_shard`` or `mixprec.fully_shard`) are DTensors; a
    low-memory optimizer keeps each rank's shard of its state as plain tensors, which
    ``torch.distributed.checkpoint`` takes for one replicated tensor: a checkpoint would keep
    one rank's state for all and cannot reshard blockwise 8-bit codes. `optimizer`: a torch
    optimizer or an `AmpOptimizer`; `entry`: the call that refuses it, for the message.
    Cheap: a look at the param groups (DTensor is only looked for when it is imported).

    Raises:
        DistributedError: the optimizer is a low-memory one and steps a DTensor.
    """
    from mixprec.levels.optimizer import AmpOptimizer
    from mixprec.optim.lowmem import LowMemOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, AmpOptimizer) else optimizer
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None or not isinstance(inner, LowMemOptimizer):
        return
    if not any(isinstance(p, tensor.DTensor) for g in inner.param_groups for p in g["params"]):
        return
    raise DistributedError(
        f"{entry}: {type(inner).__name__} (a mixprec low-memory optimizer) over parameters "
        f"sharded by FSDP2 (torch's fully_shard or mixprec.fully_shard) is not supported yet: "
        f"it keeps each rank's shard of its states as plain tensors, so a checkpoint "
        f"(torch.distributed.checkpoint) would keep one rank's state for every rank, and DCP "
        f"cannot reshard blockwise 8-bit states. Use low-memory optimizers with one process or "
        f"DDP, or on a sharded model step a torch optimizer (e.g. torch.optim.AdamW) with "
        f"mixprec.fully_shard at O2 (its fp32 shards are the masters)."
    )
