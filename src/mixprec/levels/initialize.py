"""`initialize` and `scale_loss`: Apex amp's workflow, on modern PyTorch, without global state.

    model, optimizer = mixprec.initialize(model, optimizer, opt_level="O2")
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        with mixprec.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

Everything an opt level needs travels with the returned objects: the model carries its hooks,
the returned optimizer (an `AmpOptimizer`) carries the master weights and the loss scaler.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.errors import ArgumentTypeError, UsageError
from mixprec.fp8.convert import NoFp8LayerError, check_converts, fp8_layers, to_fp8
from mixprec.heal.online import attach_healer
from mixprec.levels import keep_fp32
from mixprec.levels.model import AmpHooks, amp_hooks, cast_model
from mixprec.levels.model_state import MasterMap, register_state_hooks
from mixprec.levels.optimizer import (
    LOW_PRECISION,
    AmpOptimizer,
    LossScaling,
    build_inner,
    check_rebuildable,
    optimizer_like,
    rebuild_wrapper,
    wrapped_optimizer,
)
from mixprec.levels.presets import AmpOptions, OptLevel, resolve
from mixprec.optim import lowmem
from mixprec.scaling.scaler import GradScaler

__all__ = ["initialize", "master_params", "scale_loss"]

OptimizerLike = torch.optim.Optimizer | Callable[[list[torch.Tensor]], torch.optim.Optimizer]
_VERBOSITY = (0, 1, 2)


def _device_type(models: Sequence[nn.Module]) -> str:
    from mixprec.distributed.fsdp import sharded_options

    for model in models:
        sharded = sharded_options(model)
        if sharded is not None:  # the device it was sharded for (its shards may sit offloaded)
            return sharded.device_type
        for p in model.parameters():
            return p.device.type
    return "cpu"


def initialize(
    models: nn.Module | Sequence[nn.Module],
    optimizers: OptimizerLike | Sequence[OptimizerLike] | None = None,
    opt_level: str | OptLevel = "O1",
    *,
    dtype: str | torch.dtype | None = None,
    enabled: bool = True,
    verbosity: int = 0,
    **overrides: Any,
) -> Any:
    """Prepare models and optimizers for an opt level; return them like Apex's ``initialize``.

    Args:
        models: a model or a list of models (fp32, on their device). They are modified in place
            (weights cast for O2/O3, hooks added) and returned.
        optimizers: an optimizer, a list, a factory ``params -> optimizer`` (needed for O2 with
            optimizers whose class cannot be rebuilt from ``defaults``), or None for inference.
            An object that wraps an optimizer and exposes ``param_groups``, ``state``, ``step``
            and ``zero_grad`` (Apex's LARC) is taken as one; for O2 it is copied around a
            rebuilt inner optimizer (the object passed in is left alone).
        opt_level: ``'O0'`` ... ``'O4'``; ``mixprec.describe(level)`` explains. ``master_weights``
            also takes ``'stochastic'`` or ``'kahan'`` (no fp32 masters: low-memory updates of
            the low-precision weights); with those, or ``optimizer_states`` other than
            ``'fp32'``, torch's AdamW, Adam and SGD are replaced by mixprec's `LowMemAdamW`,
            `LowMemAdam` and `LowMemSGD` with the same hyperparameters.
        dtype: the low dtype; default fp16 on CUDA, bf16 on CPU.
        enabled: False is Apex's off switch: the level becomes O0 and the overrides are ignored
            (the objects still come back wrapped, so ``scale_loss`` works unchanged).
        verbosity: 1 or 2 print the resolved options (Apex printed them by default; mixprec's
            default, 0, prints nothing: ``mixprec.describe`` shows the same, with reasons).
        overrides: Apex's option names (``cast_model_type``, ``keep_batchnorm_fp32``,
            ``master_weights``, ``loss_scale``, ``min_loss_scale``, ``max_loss_scale``,
            ``cast_model_outputs``, ``patch_torch_functions``) plus ``num_losses``,
            ``optimizer_states`` (``'fp32'``, ``'bf16'``, ``'8bit'``, ``'8bit-bound'``),
            ``seed`` (of stochastic rounding), ``policy`` (the op policy for O1's autocast,
            and its FP8 module rules) and ``fp8`` (an `Fp8Recipe` or its name: the policy's
            FP8 layers, by default every linear layer with sizes multiple of 16 except the
            first and the last, become `Fp8Linear`s).

    Returns:
        ``model`` (inference), or ``(model, optimizer)``; lists where lists were given. The
        optimizers are `AmpOptimizer`s; the scaler is ``optimizer.scaler``.

    Distributed: a model wrapped in ``DistributedDataParallel`` is accepted for O0 and O1 (for
    O2/O3 initialize first, then wrap); a model sharded by `mixprec.fully_shard` keeps the level
    it was sharded at, and only the optimizer side (scaler, no master copies: FSDP's fp32 shards
    are the masters) is added here. See docs/distributed.md.

    Raises:
        PolicyError: an unknown level or option, or options that contradict each other. As
            Apex: for an unknown level, a conflict, or an optimizer given twice it is also a
            RuntimeError (`UsageError`); for arguments of the wrong type or unknown keywords
            also a TypeError (`ArgumentTypeError`).
        MixprecError: a model initialized twice, or an optimizer that cannot be rebuilt.
        DistributedError: a DDP or FSDP2 model in an order of wrapping that cannot work (the
            message gives the order that does).
    """
    from mixprec.distributed import wrapping  # DDP / FSDP2: what each order of wrapping allows

    model_list = list(models) if isinstance(models, (list, tuple)) else [models]
    if not model_list or not all(isinstance(m, nn.Module) for m in model_list):
        raise ArgumentTypeError("initialize expects an nn.Module or a list of them as `models`.")
    if not isinstance(enabled, bool):
        raise ArgumentTypeError(f"enabled={enabled!r} must be True or False.")
    if verbosity not in _VERBOSITY or isinstance(verbosity, bool):
        raise ArgumentTypeError(f"verbosity={verbosity!r} must be 0, 1 or 2.")
    if not enabled:  # Apex: every amp call a no-op, whatever else was passed
        opt_level, overrides = "O0", {}
    options = resolve(opt_level, device_type=_device_type(model_list), dtype=dtype, **overrides)
    kinds = [
        wrapping.model_kind(model, options, overrides, optimizers is not None)
        for model in model_list
    ]
    if options.fp8 is not None:  # FP8 that converts no layer says why, before any change
        check_converts(model_list, options.fp8, options.policy)
    keep_fp32.check_models(model_list, options)  # fp32 modules that name no module
    # Everything that can be refused is checked before any model is changed, so a refused
    # argument leaves the models as they were (the scaler validates its own settings).
    opt_list = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if optimizers is not None:
        ours = {id(p) for model in model_list for p in model.parameters()}
        for opt in opt_list:
            _check_optimizer_arg(opt)
            # A low-memory optimizer over FSDP2 shards (built by the caller) keeps plain
            # per-rank states that DCP would save as replicated: refused as O4 is below.
            wrapping.refuse_lowmem_on_shards(opt, "mixprec.initialize")
            held = [p for g in getattr(opt, "param_groups", ()) for p in g["params"]]
            if held and not any(id(p) in ours for p in held):
                raise UsageError(
                    f"the optimizer ({type(opt).__name__}) holds none of the model's parameters "
                    f"({len(held)} other tensors), so training would change nothing. Build it "
                    f"over the model you pass: {type(opt).__name__}(model.parameters(), ...)."
                )
            if options.master_weights and _is_wrapper(opt):
                wrapped_optimizer(opt)  # rebuilt over the masters later: refuse it now
            elif options.master_weights and isinstance(opt, torch.optim.Optimizer):
                check_rebuildable(opt)  # the same: its class must take its groups and defaults
            if options.master_weights or options.low_memory:
                _check_no_scheduler(opt, options)
            if options.low_memory:
                lowmem.check_convertible(opt)  # replaced by a low-memory one later: refuse it now
        if options.low_memory and "sharded" in kinds:
            raise UsageError(
                "low-memory weights and optimizer states (opt_level='O4', master_weights="
                "'stochastic'/'kahan'/'split', optimizer_states='bf16'/'8bit'/'8bit-bound') "
                "are not supported on a model sharded by mixprec.fully_shard yet: DCP cannot "
                "reshard blockwise 8-bit states. Use them with one process or DDP, or shard "
                "with O2 and optimizer_states='fp32'."
            )
        _check_unscalable(model_list, options)
    scaler = _make_scaler(options) if optimizers is not None else None
    if verbosity and _is_rank0():
        print(options)
    masters: dict[int, torch.Tensor] = {}
    master_map = MasterMap()  # what the cast models' state dicts read and loads write
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (low-precision weight, its master)
    fp8: list[Any] = []  # the models' FP8 layers (fp8_update runs after each optimizer step)
    for i, (model, kind) in enumerate(zip(model_list, kinds, strict=True)):
        if kind == "sharded":  # mixprec.fully_shard applied the level: FSDP's shards are masters
            fp8 += [layer for _, layer in fp8_layers(model)]  # (and the FP8 recipe)
            continue
        if options.fp8 is not None:
            try:
                converted = to_fp8(model, options.fp8, options.policy)
            except NoFp8LayerError as err:  # another model has FP8 layers (checked above)
                warnings.warn(str(err), stacklevel=2)
                converted = model
            if converted is not model:  # the model was one nn.Linear: return its replacement
                model_list[i] = model = converted
            fp8 += [layer for _, layer in fp8_layers(model)]
        pairs += _prepare_model(model, options, masters, master_map)

    if isinstance(models, (list, tuple)) and any(
        a is not b for a, b in zip(models, model_list, strict=True)
    ):
        models = type(models)(model_list)  # a model that was one nn.Linear was replaced
    if optimizers is None:
        return models if isinstance(models, (list, tuple)) else model_list[0]
    scaling = LossScaling(scaler)
    wrapped = []
    for opt in opt_list:
        inner = _inner_optimizer(opt, masters, model_list)
        if inner is opt:
            _recast_state(opt)
        if options.low_memory and not isinstance(inner, lowmem.LowMemOptimizer):
            # The same hyperparameters, stepping the same tensors (the model's low-precision
            # weights, or O2's masters), with the level's weights and states modes.
            inner = lowmem.converted(
                inner,
                weights=options.low_weights or "nearest",
                states=options.optimizer_states,
                seed=options.seed,
            )
        mine = {id(p) for g in inner.param_groups for p in g["params"]}
        own = [(low, m) for low, m in pairs if id(m) in mine]
        # An FP8 layer advances with the optimizer that steps its weight (or its master).
        layers = [f for f in fp8 if id(masters.get(id(f.weight), f.weight)) in mine]
        lows, ms = [lo for lo, _ in own], [m for _, m in own]
        wrapped.append(AmpOptimizer(inner, options, scaling, lows, ms, layers, master_map))
        # Whether a model's last forward ran in DDP's no_sync() (wrapped after initialize).
        wrapped[-1]._hooks = [h for m in model_list if (h := amp_hooks(m)) is not None]
    for model, kind in zip(model_list, kinds, strict=True):
        if kind == "sharded":
            wrapping.find_hooks(model).optimized = True
    # Under DDP the scaler's own agreement all-reduce is redundant (agreement.py says why).
    wrapping.register_replicated(model_list, wrapped)
    attach_healer(model_list, wrapped, scaling, options)  # heal=...: optimizer.healer
    out_models = models if isinstance(models, (list, tuple)) else model_list[0]
    out_opts = wrapped if isinstance(optimizers, (list, tuple)) else wrapped[0]
    return out_models, out_opts


def _check_no_scheduler(opt: Any, options: AmpOptions) -> None:
    """Warn about an optimizer that a learning-rate scheduler already drives, when the level
    steps a new one (O2's masters, O4's low-memory optimizer): the scheduler keeps setting the
    lr of the optimizer passed in, which no longer steps anything, so training would run at
    the first lr. (Apex patched the optimizer in place, so its order of calls did not matter.)
    A warning, not an error: ``SkipAwareLR(scheduler, scaler, optimizer=amp_optimizer)`` is the
    documented way to keep such a scheduler."""
    fields = getattr(opt, "__dict__", None) or {}  # a wrapper (LARC) holds the optimizer
    candidates = [opt, *(v for v in fields.values() if isinstance(v, torch.optim.Optimizer))]
    if any(getattr(getattr(o, "step", None), "_wrapped_by_lr_sched", False) for o in candidates):
        what = "over fp32 master weights" if options.master_weights else "with low-memory states"
        warnings.warn(
            f"a learning-rate scheduler was created on this {type(opt).__name__} before "
            f"initialize, but {options.level.value} steps a new optimizer {what}: the "
            f"scheduler sets the lr of an optimizer that no longer steps, so the schedule "
            f"would not apply. Create the scheduler after initialize, on the optimizer it "
            f"returns (scheduler = torch.optim.lr_scheduler.X(optimizer, ...)), or let it "
            f"follow that optimizer: mixprec.SkipAwareLR(scheduler, scaler, "
            f"optimizer=amp_optimizer).",
            UserWarning,
            stacklevel=3,
        )


def _recast_state(opt: Any) -> None:
    """Cast the state an optimizer already holds (loaded before initialize, or from fp32
    steps) to its parameters' new dtype, as torch's ``load_state_dict`` casts it (Apex did the
    same): O3's bf16 weights with fp32 moments failed in the first step."""
    state = getattr(opt, "state", None)
    if not isinstance(opt, torch.optim.Optimizer) or not state:
        return
    stale = any(
        isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0
        and v.dtype != p.dtype
        for p, entry in state.items()
        for k, v in entry.items()
        if k != "step"
    )  # fmt: skip
    if stale:
        opt.load_state_dict(opt.state_dict())


def _is_wrapper(opt: Any) -> bool:
    return optimizer_like(opt) and not isinstance(opt, torch.optim.Optimizer)


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _check_unscalable(models: list[nn.Module], options: AmpOptions) -> None:
    """Refuse fp16 weights whose gradients a loss scaler would have to unscale in fp16."""
    if not options.uses_scaler or options.master_weights:
        return
    low_model = options.cast_model_type not in (None, torch.float32)
    for model in models:
        for name, p in model.named_parameters():
            if p.requires_grad and p.dtype == torch.float16 and not low_model:
                raise UsageError(
                    f"{options.level.value} scales the loss, but parameter {name!r} of "
                    f"{type(model).__name__} is fp16: its gradients would have to be unscaled "
                    f"in fp16, where their small values underflow (torch.amp's GradScaler "
                    f"refuses them too; Apex refused fp16 parameters in initialize). Pass an "
                    f"fp32 model (O1 casts per op), or keep fp32 master weights for the fp16 "
                    f"parameters: opt_level='O2' with cast_model_type=False keeps the model's "
                    f"dtypes as they are."
                )


def _prepare_model(
    model: nn.Module,
    options: AmpOptions,
    masters: dict[int, torch.Tensor],
    master_map: MasterMap | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if master_map is None:  # a caller with its own bookkeeping (mixprec.integrations)
        master_map = MasterMap()
    low = options.dtype
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    if options.master_weights:
        # Masters are taken before the cast: they hold the full fp32 values.
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and id(p) not in masters:
                    masters[id(p)] = p.detach().clone().float()
    fp32_norms: list[nn.Module] = []
    model_type = options.cast_model_type
    if model_type is not None and model_type != torch.float32:
        fp32_norms = cast_model(model, model_type, options.keep_batchnorm_fp32)
    if options.master_weights:
        for p in model.parameters():
            m = masters.get(id(p))
            if m is None:
                continue
            if p.dtype not in LOW_PRECISION:  # fp32 (a norm layer; an uncast model): its own
                masters[id(p)] = p
            else:
                m.requires_grad_(p.requires_grad)
                pairs.append((p, m))
                master_map.add(p, m)
    low_model = model_type is not None and model_type != torch.float32
    region = (options.device_type, low, options.policy) if options.patch_torch_functions else None
    hooks = AmpHooks(
        model,
        input_dtype=model_type if low_model else None,
        output_dtype=options.cast_model_outputs,
        region=region,
        fp32_norms=fp32_norms,
        low=low,
    )
    if low_model:  # checkpoints stay fp32, as Apex's did (mixprec.levels.model_state)
        hooks.add_handles(register_state_hooks(model, model_type, master_map))
    keep_fp32.install(model, hooks, options)  # O1: the policy's fp32 modules, healing's moves
    return pairs


def _inner_optimizer(
    opt: OptimizerLike, masters: dict[int, torch.Tensor], models: list[nn.Module]
) -> torch.optim.Optimizer:
    if isinstance(opt, torch.optim.Optimizer):
        return build_inner(opt, masters) if masters else opt
    if optimizer_like(opt):  # a wrapper such as Apex's LARC
        return rebuild_wrapper(opt, masters) if masters else opt
    if callable(opt):  # a factory: give it the masters (or the model's parameters)
        params = [masters.get(id(p), p) for m in models for p in m.parameters()]
        inner = opt(params)
        if not optimizer_like(inner):
            raise ArgumentTypeError(
                f"the optimizer factory returned {type(inner).__name__}, not a "
                f"torch.optim.Optimizer (or an object with param_groups, state, step and "
                f"zero_grad)."
            )
        return inner
    raise AssertionError("unreachable: _check_optimizer_arg accepted it")  # pragma: no cover


def _check_optimizer_arg(opt: Any) -> None:
    if isinstance(opt, AmpOptimizer):
        raise UsageError(
            "this optimizer was already returned by mixprec.initialize; pass each optimizer "
            "through initialize once (Apex refused this too)."
        )
    if optimizer_like(opt) or (callable(opt) and not isinstance(opt, nn.Module)):
        return
    hint = ""
    if isinstance(opt, (Iterator, nn.Module)):
        hint = (" (parameters or a model, not an optimizer: build one, e.g. "
                "torch.optim.AdamW(model.parameters(), lr=1e-3))")  # fmt: skip
    raise ArgumentTypeError(
        f"optimizers must be torch.optim.Optimizer instances, objects used as optimizers "
        f"(with param_groups, state, step and zero_grad, such as Apex's LARC), factories or "
        f"None; got {type(opt).__name__}{hint}."
    )


def _make_scaler(options: AmpOptions) -> GradScaler | None:
    if not options.uses_scaler:
        return None
    dynamic = options.dynamic_loss_scale
    return GradScaler(
        options.device_type,
        init_scale=2.0**16 if dynamic else float(options.loss_scale),
        dynamic=dynamic,
        min_scale=options.min_loss_scale,
        max_scale=options.max_loss_scale,
        num_losses=options.num_losses,
    )


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: AmpOptimizer | Sequence[AmpOptimizer],
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield the loss scaled for backward; on exit, move and unscale the gradients.

    ``with mixprec.scale_loss(loss, optimizer) as scaled: scaled.backward()``. Inside, gradients
    are ``scale * g``; on exit they are unscaled and checked for overflow (charged to loss
    `loss_id`). In O2 they are moved into the fp32 master weights, so code after the block that
    reads ``mixprec.master_params(optimizer)`` (clipping, logging) sees true fp32 gradients;
    without loss scaling (bf16) the move waits until then, or until the step, which keeps O2's
    training state between backward and step at fp32 training's (`AmpOptimizer`). Several
    blocks per iteration accumulate, in fp32.

    `model`, `delay_unscale` and `delay_overflow_check` are Apex's keywords, accepted so Apex
    code runs unchanged, and have no effect: Apex needed ``delay_unscale=True`` on all but the
    last block of an accumulation, where mixprec's blocks accumulate correctly as they are
    (each block's gradients are unscaled into the running fp32 sum); the other two were unused
    in Apex too.
    """
    for name, value in (("delay_unscale", delay_unscale),
                        ("delay_overflow_check", delay_overflow_check)):  # fmt: skip
        if not isinstance(value, bool):
            raise ArgumentTypeError(f"scale_loss: {name}={value!r} must be True or False.")
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not opts or not all(isinstance(o, AmpOptimizer) for o in opts):
        # A RuntimeError too, as Apex's scale_loss raised before initialize.
        raise UsageError(
            "scale_loss expects the optimizer(s) returned by mixprec.initialize (AmpOptimizer)."
        )
    scaling = opts[0]._scaling
    if any(o._scaling is not scaling for o in opts):
        raise UsageError(
            "scale_loss got optimizers from different mixprec.initialize calls; pass the "
            "optimizers of one call (they share one loss scaler)."
        )
    scaling.flush()  # the previous iteration's deferred scale update
    scaling.scaled = True
    for o in opts:
        o._start_backward()
    scaler = scaling.scaler
    if scaler is None:
        yield loss
        for o in opts:  # (O2) they stay in the low dtype until the step needs them in fp32
            o._after_backward(defer=True)
        return
    with scaler.scaled(loss, [o.optimizer for o in opts], loss_id) as scaled:
        yield scaled
        for o in opts:  # into the masters first: the scaler unscales what the optimizer steps
            o._after_backward()


def master_params(optimizer: AmpOptimizer) -> Iterator[torch.Tensor]:
    """The tensors `optimizer` steps: fp32 masters in O2, the model's weights otherwise.

    Clip these (``torch.nn.utils.clip_grad_norm_(mixprec.master_params(opt), 1.0)``) after
    ``scale_loss`` and before ``step``. Any optimizer is accepted, as Apex did: one that
    ``initialize`` did not return steps its own parameters.
    """
    if not optimizer_like(optimizer):
        raise ArgumentTypeError(
            f"master_params expects an optimizer (one returned by mixprec.initialize), got "
            f"{type(optimizer).__name__}."
        )
    scaler = getattr(optimizer, "scaler", None)
    inner = getattr(optimizer, "optimizer", None)
    if scaler is not None and id(inner) in getattr(scaler, "_deferred", {}):
        raise UsageError(
            f"master_params: the gradients of this {optimizer.options.level.value} optimizer "
            f"are fp16 and still scaled (fp16 cannot hold them unscaled without losing their "
            f"small values; {type(inner).__name__} divides them by the scale in fp32 inside "
            f"its step), so they cannot be clipped here. Clip with dtype='bf16', or keep fp32 "
            f"masters (opt_level='O2')."
        )
    for group in optimizer.param_groups:  # an AmpOptimizer's moves a bf16 backward's grads
        yield from group["params"]
