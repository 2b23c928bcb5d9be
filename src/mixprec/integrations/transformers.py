"""mixprec in ``transformers.Trainer``: a mixin, a ready Trainer, and a metrics callback.

    from mixprec.integrations.engine import AmpConfig
    from mixprec.integrations.transformers import AmpTrainer

    trainer = AmpTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                         amp=AmpConfig("O1", dtype="fp16"))      # not args.fp16/bf16
    trainer.train()

Or mix it into your own subclass: ``class MyTrainer(AmpTrainerMixin, Trainer): ...``.

How, through the Trainer's own extension points and nothing else:

- ``create_accelerator_and_postprocess`` (overridden, super called first): the Trainer's
  Accelerator is wrapped in `mixprec.integrations.accelerate.AmpAccelerator`, which the Trainer
  then uses for ``prepare``, ``backward``, ``clip_grad_norm_`` and ``optimizer_step_was_skipped``;
- the Trainer steps its LR scheduler only ``if not accelerator.optimizer_step_was_skipped``:
  that reads mixprec's flag, one host-device sync per optimizer step. (The Trainer already
  reads the loss on the host every step for its NaN filter and logging, so this adds a read,
  not a new stall.) A skipped step therefore leaves the schedule where it was;
- ``log`` (overridden): every log line also carries the loss scale and the skipped-step and
  inf/NaN-loss counts (Megatron's names), read at the moment the Trainer logs;
- `AmpMetricsCallback` (installed unless you pass one) counts steps and, with
  ``tensorboard_dir``, writes every step's loss scale as TensorBoard scalars in batches of
  `every` steps (one sync per batch).

TrainingArguments' ``fp16``/``bf16`` must stay False (mixprec does the precision; the Trainer
would otherwise run torch.autocast and torch's GradScaler too); DeepSpeed and FSDP are refused.
Install with ``pip install -e '.[hf]'`` (in the checkout).
"""

from __future__ import annotations

import json
import os
from typing import Any

from mixprec.integrations import require
from mixprec.integrations.engine import AmpConfig, IntegrationError, unwrap_optimizer

require("transformers", "hf", "mixprec.integrations.transformers")

import transformers  # noqa: E402

from mixprec.diagnostics.metrics import AmpMetrics, MetricsBatch  # noqa: E402
from mixprec.integrations.accelerate import AmpAccelerator  # noqa: E402

__all__ = ["AmpMetricsCallback", "AmpTrainer", "AmpTrainerMixin"]


class AmpMetricsCallback(transformers.TrainerCallback):
    """Loss-scale telemetry for ``transformers.Trainer`` runs under `AmpTrainerMixin`.

    Args:
        every: optimizer steps per device read (1..1024).
        names: ``'megatron'`` or ``'deepspeed'`` (`mixprec.diagnostics.metrics.NAMES`).
        tensorboard_dir: also write every step's values there (the ``tensorboard`` extra).
        watch: a `mixprec.watch_nonfinite` attached to the scaler, to name where skipped
            steps' infs came from.

    Attributes:
        metrics: the `mixprec.AmpMetrics` (None before training starts).
        events: ``(step, text)`` for each skipped step seen so far.
    """

    def __init__(self, every: int = 50, names: str = "megatron", tensorboard_dir: str | None = None,
                 watch: Any = None) -> None:  # fmt: skip
        self._args = {"every": every, "names": names, "watch": watch}
        AmpMetrics(None, **self._args)  # validate now
        self.tensorboard_dir = tensorboard_dir
        self.metrics: AmpMetrics | None = None
        self.events: list[tuple[int, str]] = []
        self._sink: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        amp = unwrap_optimizer(kwargs.get("optimizer"))
        scaler = getattr(amp, "scaler", None)
        self.metrics = AmpMetrics(scaler, **self._args)
        self.metrics.add_sink(self._keep_events)
        if self.tensorboard_dir is not None and state.is_world_process_zero:
            from mixprec.integrations.tensorboard import TensorBoardSink

            self._sink = TensorBoardSink(self.tensorboard_dir)
            self.metrics.add_sink(self._sink)

    def _keep_events(self, batch: MetricsBatch) -> None:
        self.events += batch.events

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.metrics is not None:
            self.metrics.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.metrics is not None:
            self.metrics.flush()
        if self._sink is not None:
            self._sink.close()


class AmpTrainerMixin:
    """Train ``transformers.Trainer`` with mixprec: ``class T(AmpTrainerMixin, Trainer)``.

    Args:
        amp: the `AmpConfig` (default: O1, fp16 on CUDA, bf16 elsewhere).
        amp_callback: the `AmpMetricsCallback` to use (default: a new one, every 50 steps).
        *args: the Trainer's positional arguments.
        **kwargs: the Trainer's keyword arguments.
    """

    def __init__(
        self,
        *args: Any,
        amp: AmpConfig | None = None,
        amp_callback: AmpMetricsCallback | None = None,
        **kwargs: Any,
    ) -> None:
        if amp is not None and not isinstance(amp, AmpConfig):
            raise IntegrationError(f"amp= must be an AmpConfig, got {type(amp).__name__}.")
        self.amp_config = amp if amp is not None else AmpConfig()
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        for flag in ("fp16", "bf16"):
            if getattr(training_args, flag, False):
                raise IntegrationError(
                    f"TrainingArguments({flag}=True) would run torch.autocast and torch's "
                    f"GradScaler as well as mixprec's: leave {flag}=False and choose the "
                    f"precision with amp=AmpConfig(dtype={flag!r})."
                )
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        callback = amp_callback
        if callback is None:
            mine = AmpMetricsCallback
            found = [c for c in self.callback_handler.callbacks if isinstance(c, mine)]
            callback = found[0] if found else AmpMetricsCallback()
        if callback not in self.callback_handler.callbacks:
            self.add_callback(callback)
        self.amp_callback = callback

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own set-up, then its Accelerator wrapped in `AmpAccelerator`."""
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            raise IntegrationError(
                "AmpTrainer does not run under DeepSpeed or FSDP, which bring their own mixed "
                "precision: use their fp16/bf16 settings with a plain Trainer instead."
            )
        self.accelerator = AmpAccelerator(self.accelerator, config=self.amp_config)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's step; its loss also feeds the inf/NaN-loss count (a device op)."""
        loss = super().training_step(*args, **kwargs)  # type: ignore[misc]
        metrics = getattr(self.amp_callback, "metrics", None)
        if metrics is not None:
            metrics.record_loss(loss)
        return loss

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        """The Trainer's save; at O2 the config names the dtype the weights were saved in.

        O2's state dict holds the fp32 masters, but ``save_pretrained`` writes the live
        parameters' dtype (fp16/bf16) into config.json, and ``from_pretrained`` would load the
        fp32 weights as low precision. The dtype entry is set to float32."""
        super()._save(output_dir, state_dict)  # type: ignore[misc]
        options = getattr(getattr(self.accelerator, "_engine", None), "options", None)
        if options is None or not options.master_weights or not self.args.should_save:
            return
        path = os.path.join(output_dir or self.args.output_dir, "config.json")
        if not os.path.isfile(path):
            return
        with open(path) as fh:
            config = json.load(fh)
        keys = [k for k in ("dtype", "torch_dtype") if k in config]
        if keys:
            for key in keys:
                config[key] = "float32"
            with open(path, "w") as fh:
                json.dump(config, fh, indent=2, sort_keys=True)

    @property
    def amp_scaler(self) -> Any:
        """The `mixprec.GradScaler` (None when the level does not scale: bf16, O3)."""
        return self.accelerator.scaler

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``, with the loss scale and the skip and inf/NaN counts added."""
        metrics = getattr(self.amp_callback, "metrics", None)
        if metrics is not None and "loss" in logs:  # training logs, where the Trainer syncs anyway
            batch = metrics.flush()
            for key, value in batch.totals.items():
                logs.setdefault(key, value)
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


class AmpTrainer(AmpTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with mixprec's precision (see `AmpTrainerMixin`)."""
