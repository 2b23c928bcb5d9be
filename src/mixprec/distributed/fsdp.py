"""`mixprec.fully_shard`: an opt level applied to a model through FSDP2's own mixed precision.

    model = Transformer()
    mixprec.fully_shard(model, opt_level="O2", units=(Block,))    # instead of fully_shard(...)
    optimizer = torch.optim.AdamW(model.parameters())              # steps the fp32 shards
    model, optimizer = mixprec.initialize(model, optimizer, opt_level="O2")  # scaler, scale_loss

Why a ``fully_shard`` of mixprec's own rather than ``initialize`` on a sharded model: FSDP2 fixes
how a parameter is stored, gathered and reduced when ``fully_shard`` runs (one
``MixedPrecisionPolicy`` per unit, and one original dtype per unit), so an opt level must be
decided there. FSDP2 users already call ``fully_shard`` bottom-up with a policy; this function
takes the same arguments (``mesh``, ``reshard_after_forward``, ``offload_policy``, ...) with
``opt_level`` in place of ``mp_policy``, and makes the units the level needs:

- **O2**: no cast and no second copy. The fp32 parameters are sharded as they are: FSDP's fp32
  shards *are* the master weights, and the optimizer steps them. Every unit all-gathers its
  parameters in the low dtype (``param_dtype``) and reduce-scatters gradients in fp32
  (``reduce_dtype``), so gradients reach the shards in fp32. Normalization layers (what
  ``keep_batchnorm_fp32`` keeps in fp32) become units of their own with an fp32 policy: inputs
  cast up, fp32 weights, output cast back to the low dtype. The root returns fp32 outputs
  (``cast_model_outputs``). Floating buffers outside norm layers are cast to the low dtype, as
  unsharded O2 does.
- **O3**: the model (norm layers too, unless ``keep_batchnorm_fp32=True``) is cast to the low
  dtype before sharding; shards are low precision, gradients are reduced in fp32 and stored in
  the low dtype. No masters.
- **O1**: the model is sharded in fp32 with no policy, and its forward runs under
  ``mixprec.autocast`` (the same hooks as ``initialize``). **O0**: plain FSDP2.
- **FP8** (``fp8='tensorwise'`` or another recipe, at O1-O3): the policy's FP8 layers become
  ``Fp8Linear`` before sharding, and their weights are all-gathered in FP8 with one scale per
  weight, computed once per all-gather (`mixprec.distributed.fp8`: half the bytes of a bf16
  gather); their amax histories agree across ranks.

Costs: each normalization layer is a unit: one small all-gather in forward and one small
reduce-scatter in backward per norm layer. Norm units keep their (tiny) unsharded parameters
from forward to backward (``reshard_after_forward=False``), so backward does not gather them
again. Name the classes to shard as units of their own (transformer blocks) with `units`:
they get the level's policy, and FSDP overlaps their communication with compute.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec.distributed.fp8 import shard_weights_in_fp8
from mixprec.distributed.topology import DistributedError, fsdp_modules
from mixprec.errors import format_options
from mixprec.fp8.convert import to_fp8
from mixprec.levels.model import NORM_LAYERS, AmpHooks, amp_hooks, cast_model
from mixprec.levels.presets import AmpOptions, OptLevel, resolve

__all__ = ["MODEL_OPTIONS", "fully_shard", "sharded_options"]

#: Apex option names that shape the model (the scaler's options belong to ``initialize``).
MODEL_OPTIONS = (
    "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
    "cast_model_outputs", "policy", "fp8",
)  # fmt: skip

Units = Iterable[type[nn.Module]] | Callable[[str, nn.Module], bool]


def _fsdp_api() -> tuple[Any, Any, set[str]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    # fully_shard's keywords differ between torch releases (dp_mesh_dims is 2.13's): take them
    # from the installed function rather than from a list written here.
    accepted = {
        name
        for name, p in inspect.signature(torch_fully_shard).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    return torch_fully_shard, MixedPrecisionPolicy, accepted - {"mp_policy"}


def _device_type(mesh: Any) -> str:
    """Where the shards will live: the mesh's device, or without one the device of FSDP2's
    default mesh, the process's accelerator (FSDP2 moves a CPU-built model there, so the
    parameters' device before sharding says nothing)."""
    if mesh is not None:
        return str(mesh.device_type)
    return torch._C._get_accelerator().type  # what FSDP2's _init_default_mesh uses


def _unit_test(units: Units) -> Callable[[str, nn.Module], bool]:
    if callable(units) and not isinstance(units, type):
        return units  # type: ignore[return-value]
    classes = tuple(units) if not isinstance(units, type) else (units,)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise DistributedError(
            f"units must be nn.Module classes or a predicate (name, module) -> bool; got "
            f"{bad[0]!r}. Example: mixprec.fully_shard(model, opt_level='O2', "
            f"units=(TransformerBlock,))."
        )
    return lambda _name, module: isinstance(module, classes)


def fully_shard(
    module: nn.Module,
    *,
    opt_level: str | OptLevel = "O2",
    dtype: str | torch.dtype | None = None,
    units: Units = (),
    **kwargs: Any,
) -> nn.Module:
    """Shard `module` with FSDP2 (``torch.distributed.fsdp.fully_shard``) at an opt level.

    Args:
        module: the fp32 model, not yet sharded and not yet initialized by mixprec (on its
            device, or on the meta device for deferred initialization).
        opt_level: ``'O0'``-``'O3'``; see the module docstring for what each does under FSDP2.
        dtype: the low dtype (default: fp16 on CUDA, bf16 on the CPU).
        units: submodules to shard as units of their own, as classes (``(Block,)``) or a
            predicate ``(name, module) -> bool``. Normalization layers are units anyway when the
            level keeps them in fp32.
        kwargs: ``fully_shard``'s own keywords (``mesh``, ``reshard_after_forward``,
            ``offload_policy``, ``shard_placement_fn``, ``ignored_params``, ...), applied to
            every unit, and the model-side opt-level options of ``initialize``
            (``keep_batchnorm_fp32``, ``cast_model_outputs``, ``cast_model_type``,
            ``master_weights``, ``patch_torch_functions``, ``policy``, and ``fp8``: a recipe,
            whose layers all-gather their weights in FP8; see the module docstring).

    Returns:
        `module`, sharded in place (an ``FSDPModule``). Build the optimizer over
        ``module.parameters()`` afterwards; ``mixprec.initialize(module, optimizer, opt_level)``
        with the same level then adds the loss scaler without copying any weight.

    Raises:
        DistributedError: the model is already sharded or initialized, an argument is unknown,
            or ``mp_policy`` was given (the opt level decides the policies).
    """
    if not isinstance(module, nn.Module):
        raise DistributedError(
            f"mixprec.fully_shard expects an nn.Module, got {type(module).__name__}."
        )
    torch_fully_shard, Policy, fsdp_keys = _fsdp_api()
    if "mp_policy" in kwargs:
        raise DistributedError(
            "mixprec.fully_shard builds each unit's MixedPrecisionPolicy from the opt level, so "
            "it takes no mp_policy. Pass opt_level=... (and dtype=...) instead, or call "
            "torch.distributed.fsdp.fully_shard yourself to use your own policy."
        )
    unknown = sorted(set(kwargs) - fsdp_keys - set(MODEL_OPTIONS))
    if unknown:
        raise DistributedError(
            f"mixprec.fully_shard got an unknown keyword {unknown[0]!r}. Valid: fully_shard's "
            f"{format_options(fsdp_keys)}, and the opt-level options "
            f"{format_options(MODEL_OPTIONS)}."
        )
    hooks = amp_hooks(module)
    if hooks is not None:
        raise DistributedError(
            f"{type(module).__name__} was already prepared by mixprec "
            f"({'mixprec.fully_shard' if hooks.sharded else 'mixprec.initialize'}). Under FSDP2 "
            f"the opt level is applied while sharding: build the fp32 model afresh, call "
            f"mixprec.fully_shard(model, opt_level=...) on it, then build the optimizer over "
            f"model.parameters() and call mixprec.initialize(model, optimizer, opt_level=...)."
        )
    sharded = fsdp_modules(module)
    if sharded:
        raise DistributedError(
            f"{_where(sharded[0][0])} is already sharded with fully_shard. mixprec.fully_shard "
            f"shards the whole model in one call, so that every unit gets the opt level's "
            f"policy: pass the unsharded model, and name the submodules to shard as units of "
            f"their own with units=(TheirClass, ...)."
        )
    fsdp_kwargs = {k: v for k, v in kwargs.items() if k in fsdp_keys}
    overrides = {k: v for k, v in kwargs.items() if k in MODEL_OPTIONS}
    options = resolve(opt_level, device_type=_device_type(fsdp_kwargs.get("mesh")),
                      dtype=dtype, **overrides)  # fmt: skip
    is_unit = _unit_test(units)

    low = options.dtype
    low_model = options.cast_model_type not in (None, torch.float32)
    fp32 = torch.float32
    keep_norms = low_model and options.keep_batchnorm_fp32
    if options.fp8 is not None:
        to_fp8(module, options.fp8, options.policy,
               amax_group=_amax_group(fsdp_kwargs.get("mesh")))  # fmt: skip
    if low_model and not options.master_weights:  # O3: the shards themselves are low precision
        cast_model(module, low, keep_norms)
    elif low_model:  # O2: parameters stay fp32 (the masters); buffers follow unsharded O2
        _cast_buffers(module, low, keep_norms)
    if options.fp8 is not None:
        shard_weights_in_fp8(module)
    gather = low if (low_model and options.master_weights) else None
    reduce = fp32 if low_model else None
    norm_policy = Policy(param_dtype=fp32, reduce_dtype=fp32, output_dtype=low)
    unit_policy = Policy(param_dtype=gather, reduce_dtype=reduce)
    root_policy = Policy(param_dtype=gather, reduce_dtype=reduce,
                         output_dtype=options.cast_model_outputs)  # fmt: skip
    norm_kwargs = {**fsdp_kwargs, "reshard_after_forward": False}
    # Bottom-up, as FSDP2 requires: named_modules() lists parents before children.
    for name, sub in reversed(list(module.named_modules())):
        if sub is module:
            continue
        if keep_norms and isinstance(sub, NORM_LAYERS):
            torch_fully_shard(sub, mp_policy=norm_policy, **norm_kwargs)
        elif is_unit(name, sub):
            torch_fully_shard(sub, mp_policy=unit_policy, **fsdp_kwargs)
    torch_fully_shard(module, mp_policy=root_policy, **fsdp_kwargs)
    region = (options.device_type, low, options.policy) if options.patch_torch_functions else None
    marker = AmpHooks(
        module,
        input_dtype=low if (low_model and gather is None) else None,  # O3: FSDP does not cast
        output_dtype=None,
        region=region,
        fp32_norms=[],
        low=low,
    )
    marker.sharded = options
    return module


def _amax_group(mesh: Any) -> Any:
    """The group FP8 histories agree across: the mesh's (its whole world if it has several
    dimensions), or without a mesh FSDP2's default, every rank."""
    import torch.distributed as dist

    if mesh is None or mesh.ndim != 1:
        return dist.group.WORLD
    return mesh.get_group()


def _where(name: str) -> str:
    return f"submodule {name!r}" if name else "the model"


def _cast_buffers(module: nn.Module, dtype: torch.dtype, keep_norms: bool) -> None:
    skip = {
        id(b)
        for m in module.modules()
        if keep_norms and isinstance(m, NORM_LAYERS)
        for b in m.buffers(recurse=False)
    }
    for m in module.modules():  # state a module keeps in fp32 (FP8 scales and histories)
        for name in getattr(m, "mixprec_fp32_buffers", ()):
            if m._buffers.get(name) is not None:
                skip.add(id(m._buffers[name]))
    with torch.no_grad():
        for b in module.buffers():
            if b.is_floating_point() and id(b) not in skip and b.dtype != dtype:
                b.data = b.data.to(dtype)


def sharding_mismatch(sharded: AmpOptions, options: AmpOptions, given: Any) -> str | None:
    """What in `options` contradicts the options a model was sharded with: ``"level"`` (the
    level or dtype, which fixed how the weights are stored, gathered and reduced), the name of a
    model-side option the caller set explicitly (a key of `given`), or None."""
    if sharded.level is not options.level or sharded.dtype != options.dtype:
        return "level"
    for key in MODEL_OPTIONS:
        if key in given and getattr(options, key) != getattr(sharded, key):
            return key
    return None


def sharded_options(model: nn.Module) -> AmpOptions | None:
    """The options `model` was sharded with by `fully_shard` (None if it was not)."""
    hooks = amp_hooks(model)
    return None if hooks is None else hooks.sharded
