"""mixprec in Lightning: precision plugins for the Trainer, Fabric and FSDP, and a metrics callback.

    trainer = lightning.Trainer(plugins=[MixprecPrecision("O2", dtype="fp16")],
                                callbacks=[AmpMetricsCallback(every=50)])

FSDP2 (``ModelParallelStrategy``): shard in ``configure_model`` with
``mixprec.fully_shard(self.model, opt_level="O2", dtype="fp16", mesh=...)`` and pass the same
`MixprecPrecision`; it recognises the sharded model (FSDP's fp32 shards are the masters) and
adds the scaler, the held schedule and clipping (docs/integrations.md). FSDP1 (``FSDPStrategy``):
`MixprecFSDPPrecision`.

A plugin replaces ``precision="16-mixed"``/``"bf16-mixed"`` (Lightning refuses both together).
What each hook does is `mixprec.integrations.engine`'s table; differences from Lightning's own
``MixedPrecision``, all deliberate:

- the scaler is `mixprec.GradScaler`: no host sync per step, exact skips for every optimizer;
- gradients are unscaled before clipping for fused optimizers too (Lightning refuses to clip
  them), and before ``clip_gradients`` in manual optimization (Lightning clips scaled ones there);
- an LR scheduler does not advance on a skipped step: ``connect`` wraps it in
  `mixprec.SkipAwareLR` (Lightning steps it anyway). On an optimizer that reads its lr on the
  host (non-fused) that costs one sync per step; ``AmpConfig(hold_schedule_on_skip=False)``
  turns it off;
- O2's optimizer steps fp32 master weights: ``connect`` hands Lightning an `AmpOptimizer`, whose
  state dict (inner optimizer, masters, scaler) is what Lightning checkpoints; the plugin's own
  state (the scaler) is saved under its class name, as Lightning does for its plugins.

Install with ``pip install -e '.[lightning]'`` (in the checkout).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from mixprec.integrations import require
from mixprec.integrations.engine import AmpConfig, AmpEngine, IntegrationError, unwrap_optimizer

require("lightning", "lightning", "mixprec.integrations.lightning")

from lightning.fabric.plugins.precision import Precision as _FabricPrecision  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.plugins.precision import FSDPPrecision as _FSDPPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import Precision as _TrainerPrecision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from mixprec.diagnostics.metrics import AmpMetrics, MetricsBatch  # noqa: E402
from mixprec.levels.model import cast_floats  # noqa: E402
from mixprec.levels.optimizer import AmpOptimizer  # noqa: E402
from mixprec.scaling.scaler import GradScaler  # noqa: E402
from mixprec.scaling.schedule import SkipAwareLR  # noqa: E402

__all__ = [
    "AmpMetricsCallback",
    "MixprecFSDPPrecision",
    "MixprecFabricPrecision",
    "MixprecPrecision",
]

log = logging.getLogger("mixprec")


def _config(config: AmpConfig | None, opt_level: str, dtype: Any, **fields: Any) -> AmpConfig:
    if config is not None:
        if not isinstance(config, AmpConfig):
            raise IntegrationError(f"config= must be an AmpConfig, got {type(config).__name__}.")
        return config
    return AmpConfig(opt_level=opt_level, dtype=dtype,
                     **{k: v for k, v in fields.items() if v is not None})  # fmt: skip


def _device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _precision_name(engine: AmpEngine) -> str:
    """Lightning's name for what the level does (``trainer.precision``, model summaries)."""
    bits = "16" if engine.options.dtype == torch.float16 else "bf16"
    level = engine.options.level.value
    return "32-true" if level == "O0" else f"{bits}-true" if level == "O3" else f"{bits}-mixed"


def _routed_step(module: torch.nn.Module) -> bool:
    """Whether this call of `module` runs a step Lightning routes through a wrapper's forward.

    Under a wrapping strategy (DDP) Lightning calls ``training_step`` (``validation_step``, ...;
    in Fabric also the methods marked with ``mark_forward_method``) through the wrapper, so
    that the wrapper's forward logic runs: for the call, it sets the module's ``forward`` to a
    closure, ``wrapped_forward``, which puts the real forward back and calls the step
    (``_ForwardRedirection`` in the Trainer, ``_FabricModule._redirection_through_forward`` in
    Fabric). That call's arguments are the step's (the batch, targets included) and its result
    the step's: O2 casts neither, as on one process, where the step is called directly. The
    forward calls inside the step (``self(x)``) find the real forward and are cast.
    """
    forward = module.__dict__.get("forward")
    return (isinstance(forward, types.FunctionType) and forward.__name__ == "wrapped_forward"
            and forward.__module__.startswith("lightning."))  # fmt: skip


class _Common:
    """What the Trainer, Fabric and FSDP plugins share: the engine and its settings."""

    engine: AmpEngine

    def _init(self, config: AmpConfig, device: str | None, *, outputs_fp32: bool = False) -> None:
        self.config = config
        self.engine = AmpEngine(config, _device(device), outputs_fp32=outputs_fp32,
                                passthrough=_routed_step)  # fmt: skip
        self.device = self.engine.device_type
        self.precision = _precision_name(self.engine)  # type: ignore[assignment]

    @property
    def scaler(self) -> Any:
        """The `mixprec.GradScaler` (None when the level does not scale: bf16, O3, O0).

        Settable before training starts, as Lightning's plugins' ``scaler`` attribute is (to
        wrap it, e.g. in a ``Mock(wraps=...)``); after the optimizers are set up it would no
        longer be the one they step with, so it is refused then.
        """
        return self.engine.scaler

    @scaler.setter
    def scaler(self, scaler: Any) -> None:
        if isinstance(scaler, torch.amp.GradScaler):
            raise IntegrationError(
                f"{type(self).__name__}.scaler is a mixprec.GradScaler (torch's API, no host "
                f"sync); got a torch.amp.GradScaler. Pass its settings instead: "
                f"{type(self).__name__}(..., scaler={{'init_scale': 1024.0}})."
            )
        if self.engine.optimizers:
            raise IntegrationError(
                f"{type(self).__name__}.scaler was set after its optimizers were set up, which "
                f"keep the scaler they were set up with. Set it before trainer.fit / "
                f"fabric.setup, or pass its settings: {type(self).__name__}(..., scaler={{...}})."
            )
        self.engine.scaler = scaler

    def autocast_context_manager(self) -> AbstractContextManager:
        """The region the forward runs in, as Lightning's ``MixedPrecision`` has it: a
        ``mixprec.autocast`` (device, dtype, policy) for O1; a null context for O2, O3 and O0,
        whose model is cast instead."""
        return self.engine.autocast()

    def forward_context(self) -> AbstractContextManager:
        return self.autocast_context_manager()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.engine.convert_module(module)

    def main_params(self, optimizer: Any) -> Iterator[torch.Tensor]:
        return self.engine.main_params(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine.options.level.value}, {self.precision})"


class MixprecPrecision(_Common, _TrainerPrecision):
    """mixprec's opt levels as a ``lightning.Trainer`` precision plugin.

    Args:
        opt_level: ``'O1'`` (autocast + loss scaling, like ``'16-mixed'``), ``'O2'`` (low-precision
            model with fp32 masters), ``'O3'`` (pure low precision) or ``'O0'``.
        dtype: ``'fp16'`` (scaled with `mixprec.GradScaler`) or ``'bf16'``; default fp16 on
            CUDA, bf16 elsewhere.
        device: the device type training runs on (default: cuda if available, else cpu).
        policy: a `mixprec.Policy` or its string form, for O1's autocast (see `AmpConfig`).
        scaler: `mixprec.GradScaler` keyword arguments, used when the level scales (fp16).
        options: ``mixprec.initialize``'s option overrides (``keep_batchnorm_fp32``, ...).
        hold_schedule_on_skip: hold LR schedulers still on skipped steps (default True).
        config: an `AmpConfig` instead of the arguments above.

    Example::

        trainer = lightning.Trainer(plugins=[MixprecPrecision("O1", dtype="fp16")])
    """

    def autocast_context_manager(self) -> AbstractContextManager:
        """As `_Common`'s, with the weight-cast cache off, as Lightning's Trainer plugin has
        it (``torch.autocast(..., cache_enabled=False)``): the same bits as its plugin where a
        weight is used twice in one forward (tied embeddings)."""
        return self.engine.autocast(cache_enabled=False)

    def __init__(
        self,
        opt_level: str = "O1",
        dtype: str | torch.dtype | None = None,
        *,
        device: str | None = None,
        policy: Any = None,
        scaler: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        hold_schedule_on_skip: bool | None = None,
        config: AmpConfig | None = None,
    ) -> None:
        self._init(_config(config, opt_level, dtype, policy=policy, scaler=scaler,
                           options=options, hold_schedule_on_skip=hold_schedule_on_skip),
                   device)  # fmt: skip

    def connect(
        self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        """Hand Lightning `AmpOptimizer`s, and LR schedulers that hold still on skipped steps.

        On a sharded model (FSDP2 in ``configure_model``; FSDP1) Lightning keeps the user's own
        optimizers: they step the fp32 shards, which are the masters, and the strategy saves
        and loads their sharded state with ``torch.distributed.checkpoint``, which needs plain
        torch optimizers. Their `AmpOptimizer`s stay with the plugin, whose ``optimizer_step``
        finds them; the scaler is saved as the plugin's state.
        """
        self.engine.forget_optimizers(keep=optimizers)  # an earlier fit's
        amps = [self.engine.wrap_optimizer(opt) for opt in optimizers]
        by_id = {id(opt): amp for opt, amp in zip(optimizers, amps, strict=True)}
        for config in lr_schedulers:
            _hold_schedule(config, by_id, self.engine, self.config.hold_schedule_on_skip)
        if self._keeps_torch_optimizers:
            return model, list(optimizers), lr_schedulers
        return model, amps, lr_schedulers

    @property
    def _keeps_torch_optimizers(self) -> bool:
        return self.engine.sharded

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        return super().pre_backward(self.engine.scale(tensor), module)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        self.engine.after_backward()
        return super().post_backward(tensor, module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Closure (forward, backward), unscale, Lightning's hooks and clipping, scaled step.

        Keyword arguments go to the optimizer's ``step``. Without loss scaling and masters (bf16
        at O1 or O3) the optimizer runs the closure itself, as under Lightning's own plugins, so
        optimizers that evaluate it several times (LBFGS) work; with them, the closure runs
        first and such optimizers are refused.
        """
        if self.engine.takes_closure(optimizer):
            wrapped = functools.partial(self._wrap_closure, model, optimizer, closure)
            return self.engine.step(optimizer, closure=wrapped, **kwargs)
        inner = unwrap_optimizer(optimizer)
        if isinstance(getattr(inner, "optimizer", inner), torch.optim.LBFGS):
            raise IntegrationError(
                f"LBFGS re-evaluates the loss inside its step, which "
                f"{self.engine.options.level.value} with {self.precision!r} cannot follow (the "
                f"loss is scaled, or fp32 masters are stepped). Use MixprecPrecision('O1', "
                f"dtype='bf16') or 'O3' with bf16 (no scaling, no masters), or another optimizer."
            )
        closure_result = closure()
        # As Lightning: a training_step that returned None ran no backward; nothing to step.
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward:
            self.engine.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skipped_backward:
            return closure_result
        return self.engine.step(optimizer, **kwargs)

    def clip_gradients(  # type: ignore[override]
        self,
        optimizer: Any,
        clip_val: float = 0.0,
        gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0:
            self.engine.unscale_(optimizer)  # manual optimization clips before the step
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)


def _hold_schedule(config: Any, by_id: dict[int, AmpOptimizer], engine: AmpEngine,
                   hold: bool) -> None:  # fmt: skip
    """Wrap `config.scheduler` in SkipAwareLR where it would step on skipped steps (or where O2
    moved the lr it must write to the optimizer of the masters)."""
    sched = config.scheduler
    lr_scheduler = torch.optim.lr_scheduler
    if isinstance(sched, (SkipAwareLR, lr_scheduler.ReduceLROnPlateau)):
        return
    if not isinstance(sched, lr_scheduler.LRScheduler):
        return
    amp = by_id.get(id(getattr(sched, "optimizer", None)))
    if amp is None:
        return
    rebind = amp.optimizer is not sched.optimizer  # O2: the lr lives in the masters' optimizer
    scaler = engine.scaler if hold else None
    if scaler is not None and not isinstance(scaler, GradScaler):
        # A scaler set by hand (a Mock(wraps=...) in tests): SkipAwareLR reads a
        # mixprec.GradScaler's skip flags on the device and cannot follow another one.
        log.warning("mixprec: the LR schedule steps on skipped steps too: the plugin's scaler "
                    "(%s) is not a mixprec.GradScaler.", type(scaler).__name__)  # fmt: skip
        scaler = None
    if scaler is None and not rebind:
        return
    # The torch optimizer that steps (O2: the masters'), not its AmpOptimizer: Lightning's
    # LearningRateMonitor matches `scheduler.optimizer` against each of `trainer.optimizers`
    # unwrapped (`.optimizer`), and logged the optimizer a second time ('lr-AdamW' beside the
    # scheduler's 'lr') when they differed. The scaler finds the skip flag from either.
    config.scheduler = SkipAwareLR(sched, scaler, optimizer=amp.optimizer)


class MixprecFabricPrecision(_Common, _FabricPrecision):
    """mixprec's opt levels as a ``lightning.Fabric`` precision plugin.

    O1 and O3 need nothing else: ``model, optimizer = fabric.setup(model, optimizer)``. O2 steps
    fp32 master weights, which must replace the optimizer, and Fabric gives a precision plugin no
    hook for that: set up with ``fabric.setup(*precision.initialize(model, optimizer))``.
    Fabric checkpoints only what you list: add the plugin to save the scaler, e.g.
    ``fabric.save(path, {"model": model, "optimizer": optimizer, "amp": precision})``.

    O1 returns the model's floating outputs in fp32 (as Fabric's ``'16-mixed'`` does); inputs are
    not pre-cast (the policy decides each op's dtype).
    """

    def __init__(
        self,
        opt_level: str = "O1",
        dtype: str | torch.dtype | None = None,
        *,
        device: str | None = None,
        policy: Any = None,
        scaler: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        config: AmpConfig | None = None,
    ) -> None:
        self._init(_config(config, opt_level, dtype, policy=policy, scaler=scaler,
                           options=options), device)  # fmt: skip
        self._amps: dict[int, AmpOptimizer] = {}
        self._backward_pending = False  # a backward ran since the last optimizer step

    def initialize(self, model: torch.nn.Module, *optimizers: Any) -> tuple[Any, ...]:
        """Apply the level to `model` and wrap `optimizers` (O2: over fp32 masters).

        Returns ``(model, *optimizers)`` for ``fabric.setup``.
        """
        self.engine.convert_module(model)
        return (model, *(self._amp_for(opt) for opt in optimizers))

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.engine.options.master_weights and not any(
            m is module for m in self.engine._modules
        ):
            raise IntegrationError(
                f"MixprecFabricPrecision({self.engine.options.level.value!r}) keeps fp32 master "
                f"weights in the optimizer, and Fabric gives precision plugins no way to replace "
                f"an optimizer. Set up with: model, optimizer = "
                f"fabric.setup(*precision.initialize(model, optimizer))."
            )
        return self.engine.convert_module(module)

    def _amp_for(self, optimizer: Any) -> AmpOptimizer:
        opt = unwrap_optimizer(optimizer)
        if isinstance(opt, AmpOptimizer):
            return self.engine.wrap_optimizer(opt)  # ours (raises for a foreign one)
        amp = self._amps.get(id(opt))
        if amp is None:
            amp = self._amps[id(opt)] = self.engine.wrap_optimizer(opt)
            # Created at its first unscale or step: after this iteration's backward, if any.
            amp._scaling.scaled = self._backward_pending
        return amp

    def convert_output(self, data: Any) -> Any:
        if self.engine.options.patch_torch_functions:  # O1: as Fabric's '16-mixed'
            return cast_floats(data, torch.get_default_dtype())
        return data

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        self.engine.scale(tensor).backward(*args, **kwargs)
        self._backward_pending = True

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        self.engine.after_backward()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The scaled step; keyword arguments (a closure too, without scaling and masters: bf16
        at O1 or O3) go to the optimizer's ``step``."""
        result = self.engine.step(self._amp_for(optimizer), **kwargs)
        self._backward_pending = False
        return result

    def unscale_gradients(self, optimizer: Any) -> None:
        self.engine.unscale_(self._amp_for(optimizer))

    def main_params(self, optimizer: Any) -> Iterator[torch.Tensor]:
        return self.engine.main_params(self._amp_for(optimizer))


class MixprecFSDPPrecision(MixprecPrecision, _FSDPPrecision):
    """`MixprecPrecision` for Lightning's ``FSDPStrategy`` (which accepts only FSDP plugins).

    FSDP keeps its parameters as fp32 shards, which are already the masters:

    - O1: no FSDP ``MixedPrecision`` (fp32 all-gathers), ``mixprec.autocast`` in forward;
    - O2: FSDP's ``MixedPrecision(param_dtype=low, reduce_dtype=fp32, buffer_dtype=fp32)``: the
      forward runs on low-precision gathers, gradients are reduced and kept in fp32; no mixprec
      masters and no model cast (FSDP casts per all-gather);
    - O3: ``param_dtype = reduce_dtype = low``.

    The scaler is `mixprec.GradScaler`, which all-reduces its overflow flag over the world
    (async, MAX), so every rank skips together: it replaces FSDP1's ``ShardedGradScaler``.
    Gradient clipping by norm is refused, as by Lightning's ``FSDPPrecision`` (FSDP needs the
    root module's ``clip_grad_norm_``); clipping by value works.

    Not run in mixprec's tests: FSDP1 refuses a CPU (torch 2.13 and Lightning's
    ``FSDPStrategy`` both), and they ran without a GPU. FSDP2 (`MixprecPrecision` with
    ``ModelParallelStrategy``) is the tested path.
    """

    def __init__(
        self, opt_level: str = "O1", dtype: str | torch.dtype | None = None, **kwargs: Any
    ) -> None:
        super().__init__(opt_level, dtype, **kwargs)
        opts = self.engine.options
        if opts.master_weights or opts.cast_model_type not in (None, torch.float32):
            # FSDP shards are the masters and FSDP casts per all-gather: run the level with
            # fp32 weights and no masters of our own, the loss scaling as configured.
            self._fsdp_param_dtype = opts.dtype
            self._fsdp_reduce_dtype = torch.float32 if opts.master_weights else opts.dtype
            overrides = dict(self.config.options)
            overrides.update(cast_model_type=None, master_weights=False,
                             keep_batchnorm_fp32=None)  # fmt: skip
            self.config = dataclasses.replace(self.config, options=overrides)
            self.engine = AmpEngine(self.config, self.device, passthrough=_routed_step)
        else:
            self._fsdp_param_dtype = self._fsdp_reduce_dtype = None

    @property
    def mixed_precision_config(self) -> Any:
        """FSDP1's ``MixedPrecision`` for the level (None: fp32 all-gathers, O1)."""
        if self._fsdp_param_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecision

        return MixedPrecision(param_dtype=self._fsdp_param_dtype,
                              reduce_dtype=self._fsdp_reduce_dtype,
                              buffer_dtype=torch.float32)  # fmt: skip

    @property
    def _keeps_torch_optimizers(self) -> bool:
        return True  # FSDP1 checkpoints the optimizer through FSDP.optim_state_dict

    def tensor_init_context(self) -> AbstractContextManager:
        return _TrainerPrecision.tensor_init_context(self)

    def module_init_context(self) -> AbstractContextManager:
        return _TrainerPrecision.module_init_context(self)

    def convert_input(self, data: Any) -> Any:
        return data

    def convert_output(self, data: Any) -> Any:
        return data

    def clip_grad_by_norm(self, *_: Any, **__: Any) -> None:
        raise IntegrationError(
            "gradient_clip_algorithm='norm' is not supported with FSDP's precision plugins (FSDP "
            "needs the root module's clip_grad_norm_); use gradient_clip_algorithm='value'."
        )


class AmpMetricsCallback(Callback):
    """Log the loss scale, skipped steps and inf/NaN losses to the Trainer's loggers.

    Works with the mixprec plugins above. Every `every` optimizer steps the values of all those
    steps come off the device at once (one sync) and each logger gets one ``log_metrics`` call
    per step, at that step, under Megatron's names by default (`mixprec.AmpMetrics`). Skipped
    steps are also reported in the "mixprec" logging channel, with the first non-finite module
    when `watch` (a ``mixprec.watch_nonfinite(model, attach=plugin.scaler)``) is given.

    Args:
        every: optimizer steps per read (1..1024).
        names: ``'megatron'`` or ``'deepspeed'`` (see `mixprec.diagnostics.metrics.NAMES`).
        watch: an active `mixprec.watch_nonfinite` to name where skipped steps' infs came from.
    """

    def __init__(self, every: int = 50, names: str = "megatron", watch: Any = None) -> None:
        self._args = {"every": every, "names": names, "watch": watch}
        AmpMetrics(None, **self._args)  # validate now, not at fit time
        self.metrics: AmpMetrics | None = None
        self.events: list[tuple[int, str]] = []
        self._steps_seen = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        plugin = trainer.precision_plugin
        if not isinstance(plugin, _Common):
            raise IntegrationError(
                f"AmpMetricsCallback reads mixprec's GradScaler; this Trainer's precision plugin "
                f"is {type(plugin).__name__}. Pass plugins=[MixprecPrecision(...)] instead of "
                f"precision=..."
            )
        self.metrics = AmpMetrics(plugin.scaler, **self._args)
        self.metrics.add_sink(lambda batch: self._emit(trainer, batch))
        self._steps_seen = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if self.metrics is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.metrics.record_loss(loss)
        while self._steps_seen < trainer.global_step:  # optimizer steps since the last batch
            self._steps_seen += 1
            self.metrics.step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.metrics is not None:
            self.metrics.flush()

    def _emit(self, trainer: Any, batch: MetricsBatch) -> None:
        for step, row in batch.rows:
            for logger in trainer.loggers:
                logger.log_metrics(row, step=step)
        for step, text in batch.events:
            self.events.append((step, text))
            log.warning("mixprec: %s", text)
        for logger in trainer.loggers:
            logger.save()
