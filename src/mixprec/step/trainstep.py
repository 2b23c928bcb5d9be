"""`TrainStep`: one mixed-precision training step as one call: compiled, and on CUDA captured.

    step = mixprec.TrainStep(model, optimizer, torch.nn.functional.cross_entropy, opt_level="O1")
    for x, y in loader:
        loss = step(x, y)            # a device tensor; no host sync
    print(step.reason)

A step is: zero the gradients, compute the loss (under the opt level: autocast for O1, a
low-precision model for O2/O3), scale it, backward, unscale and check the gradients, optionally
clip them, step the optimizer (skipped on the device on overflow), update the loss scale.

- On a CPU (any device but CUDA) the whole step is compiled: the forward and the loss through
  mixprec's graph pass, backward as AOTAutograd derives it, everything after backward as one
  more graph (`mixprec.step.compiled`). Compiled and eager steps agree to a few fp32 ulps
  (inductor fuses and reorders fp32 arithmetic); skips are exact.
- On CUDA the step is recorded once per input signature as a CUDA graph and replayed (see
  `mixprec.step.graphs`); with ``compile=True`` what is recorded is the compiled step.

Whenever compiling or capturing is impossible, the same code runs eagerly and `reason` says why.
Captured and eager steps run the same kernels in the same order, so they produce the same
numbers; there is no silent divergence to opt into.
"""

from __future__ import annotations

import difflib
import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from mixprec.diagnostics.watch import watcher_of
from mixprec.distributed import ddp as ddp_rules
from mixprec.distributed import wrapping
from mixprec.distributed.topology import is_initialized
from mixprec.errors import MixprecError, PolicyError, format_options
from mixprec.levels.initialize import initialize, master_params, scale_loss
from mixprec.levels.optimizer import AmpOptimizer
from mixprec.levels.presets import OptLevel
from mixprec.scaling.scaler import GradScaler
from mixprec.step import graphs
from mixprec.step.batch import BatchError, TrainStepError, batch_message, loss_from, trim
from mixprec.step.compiled import (
    CountingBackend,
    StepUpdate,
    keep_weight_layouts,
    own_code,
    tensor_lr,
)
from mixprec.step.graphs import Fingerprint, StepGraph
from mixprec.step.whole import OneGraph, trace_flag

__all__ = ["CAPTURE_MODES", "BatchError", "TrainStep"]

#: Values of ``capture``: what each does.
CAPTURE_MODES = {
    "auto": "on CUDA, capture a CUDA graph when the step allows it; on other devices, compile "
    "the whole step; else run eagerly (and say why)",
    "cuda_graph": "capture on CUDA; raise an error if the step cannot be captured",
    "compile": "compile the whole step with torch.compile on any device (no CUDA graph); raise "
    "an error if it cannot be compiled",
    "eager": "never capture; compile only if compile=True asks (else the same step, op by op)",
}

FORMAT = "mixprec.TrainStep/1"

#: Changes of a baked-in hyperparameter after which the update runs eagerly instead.
_CHURN = 4


class TrainStep:
    """A whole mixed-precision training step; CUDA-graph captured where possible.

    Args:
        model: the model (fp32, on its device). It is prepared in place by
            `mixprec.initialize` for `opt_level`, unless it was initialized already.
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters (or a factory
            ``params -> optimizer``), or an `AmpOptimizer` from a previous ``initialize`` call.
        loss_fn: ``loss_fn(model(*inputs), target)``: the last batch element is the target,
            the others go to the model.
        compute_loss: instead of `loss_fn`, ``compute_loss(model, *batch) -> loss`` for any other
            step (several outputs, auxiliary losses, keyword inputs).
        opt_level: ``'O0'``-``'O3'`` (``mixprec.describe(level)`` explains); ignored when
            `optimizer` is already an `AmpOptimizer`.
        dtype: the low dtype (default fp16 on CUDA, bf16 on the CPU).
        scaler: a `mixprec.GradScaler` to use instead of the opt level's (for example to
            scale bf16 losses, or to set hysteresis and bounds).
        clip_grad_norm: clip the unscaled gradients (fp32 masters in O2) to this total norm
            inside the step; None: no clipping.
        capture: ``'auto'``, ``'cuda_graph'``, ``'compile'`` or ``'eager'`` (see
            `CAPTURE_MODES`).
        compile: compile the step with ``torch.compile``. None (the default): the whole step
            where it is compiled by default (``capture`` ``'auto'`` or ``'compile'`` off CUDA),
            nothing otherwise. True: also on CUDA, where the compiled step is what the CUDA
            graph records. False: never. A dict is passed to ``torch.compile`` as keyword
            arguments (``mode``, ``options``, ``dynamic``); it may also name the inner
            ``backend`` and, under O1, the ``casts`` mode of `mixprec.AmpBackend`, which
            applies the opt level's policy to the whole forward graph, so the loss follows
            the policy too; ``one_graph=False`` keeps the step in two graphs off CUDA
            (`mixprec.step.whole` says when it is one).
        warmup: eager steps per input signature before capturing it, counted while the
            optimizer's hyperparameters stay unchanged (lazy initialisation, cuDNN autotuning
            and compilation happen there). Capture also waits for the step that creates the
            optimizer's state: under fp16 the first steps may all overflow and be skipped.
        max_graphs: captured graphs kept (one per input signature, least recently used out).
        ddp: wrap the initialized model in ``DistributedDataParallel`` (True, or a dict of its
            keyword arguments): in the order O2/O3 need (initialize, then DDP), and on CUDA on
            the stream the step is captured on, as PyTorch's rules for capturing DDP ask
            (`mixprec.distributed.ddp`). A model the caller wrapped in DDP works too, eagerly on
            CUDA. Under DDP the scaler skips its own overflow all-reduce (DDP reduced every
            gradient), and at least 11 eager steps run before a capture.
        overrides: Apex's option names for ``initialize`` (``keep_batchnorm_fp32``,
            ``loss_scale``, ``master_weights``, ``policy``, ...).

    Attributes:
        captured: whether the last call replayed a captured graph.
        compiled: whether the last call ran the compiled step (forward, backward and update).
        graphs_compiled: graphs compiled so far (forward and update; it grows after the first
            steps only when something dynamo guards on changes: a new input shape, say).
        reason: why the last call ran the way it did.
        notes: every automatic change made to the optimizer, with its reason.
        amp_backend: with ``compile`` under O1, the `mixprec.AmpBackend` compiling the step
            (its ``reports`` say which casts each graph makes and why); else None.

    Costs: a call does no host-device synchronisation. A capture synchronises once and holds
    a private memory pool (activations and gradients) per cached input signature.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        compute_loss: Callable[..., torch.Tensor] | None = None,
        opt_level: str = "O1",
        dtype: str | torch.dtype | None = None,
        scaler: GradScaler | None = None,
        clip_grad_norm: float | None = None,
        capture: str = "auto",
        compile: bool | dict[str, Any] | None = None,
        warmup: int = 2,
        max_graphs: int = 8,
        ddp: bool | dict[str, Any] = False,
        **overrides: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise PolicyError(
                f"TrainStep expects an nn.Module as model, got {type(model).__name__}."
            )
        if (loss_fn is None) == (compute_loss is None):
            raise PolicyError(
                "TrainStep needs exactly one of loss_fn (loss_fn(model(*inputs), target)) and "
                "compute_loss (compute_loss(model, *batch) -> loss)."
            )
        for name, fn in (("loss_fn", loss_fn), ("compute_loss", compute_loss)):
            if isinstance(fn, type):
                raise PolicyError(
                    f"TrainStep {name}={fn.__name__} is a class: pass an instance, "
                    f"{name}={fn.__name__}(), or a function such as "
                    f"torch.nn.functional.cross_entropy."
                )
            if fn is not None and not callable(fn):
                example = (
                    "loss_fn=torch.nn.functional.cross_entropy"
                    if name == "loss_fn"
                    else "compute_loss=lambda model, x, y: F.mse_loss(model(x), y)"
                )
                raise PolicyError(
                    f"TrainStep {name}={fn!r} is not callable: pass a function, e.g. {example}."
                )
        if capture not in CAPTURE_MODES:
            close = difflib.get_close_matches(str(capture).replace("-", "_"), CAPTURE_MODES, n=1)
            raise PolicyError(
                f"unknown capture mode {capture!r}."
                + (f" Did you mean {close[0]!r}?" if close else "")
                + f" Valid modes: {format_options(CAPTURE_MODES)}."
            )
        if not (compile is None or isinstance(compile, (bool, dict))):
            raise PolicyError(
                f"TrainStep compile={compile!r} must be None (automatic), True, False or a dict "
                f"of torch.compile arguments, e.g. compile={{'mode': {compile!r}}}."
            )
        if isinstance(compile, dict):
            valid = [*COMPILE_KEYS, "casts", "kernels", "one_graph"]
            unknown = [k for k in compile if k not in valid]
            if unknown:
                close = difflib.get_close_matches(str(unknown[0]), valid, n=1)
                raise PolicyError(
                    f"TrainStep compile= has unknown key {unknown[0]!r}."
                    + (f" Did you mean {close[0]!r}?" if close else "")
                    + f" Valid keys: {format_options(valid)} (torch.compile's arguments, "
                    f"mixprec's graph pass settings casts= and kernels=, and one_graph=False "
                    f"for the two-graph step)."
                )
        if capture == "compile" and compile is False:
            raise PolicyError(
                "TrainStep capture='compile' asks for a compiled step, and compile=False forbids "
                "one: drop one of them."
            )
        for name, value in (("warmup", warmup), ("max_graphs", max_graphs)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise PolicyError(f"TrainStep {name}={value!r} must be an int >= 1.")
        if clip_grad_norm is not None and not (
            isinstance(clip_grad_norm, (int, float))
            and not isinstance(clip_grad_norm, bool)
            and clip_grad_norm > 0
        ):
            raise PolicyError(
                f"clip_grad_norm={clip_grad_norm!r} must be a positive number or None."
            )
        if scaler is not None and not isinstance(scaler, GradScaler):
            raise PolicyError(
                f"scaler must be a mixprec.GradScaler, got {type(scaler).__module__}."
                f"{type(scaler).__name__}: torch.amp's scaler reads found-inf on the host every "
                f"step, which a captured step cannot do. mixprec.GradScaler takes the same "
                f"arguments."
            )

        _refuse_several_losses(scaler, optimizer, overrides)

        device = _model_device(model)
        whole = compile is not False and (
            capture == "compile"
            or bool(compile)
            or isinstance(compile, dict)  # compile={}: compiled, with torch.compile's defaults
            or (compile is None and capture == "auto" and device.type != "cuda")
        )
        if capture == "cuda_graph" and device.type != "cuda":  # before initialize changes it
            raise TrainStepError(
                f"capture='cuda_graph' cannot be honoured: CUDA graphs need a CUDA device and "
                f"the model is on {device}. Use capture='auto' to fall back to eager steps, or "
                f"move the model to a CUDA device."
            )
        ddp_kwargs = ddp_rules.requested_kwargs(ddp, model)
        wrapping.refuse_lowmem_on_shards(optimizer, "mixprec.TrainStep")  # before initialize
        if isinstance(optimizer, AmpOptimizer):
            if wrapping.find_hooks(model) is None:
                raise TrainStepError(
                    "the optimizer comes from mixprec.initialize but the model was not "
                    "initialized with it; pass the model that initialize returned."
                )
            if overrides or dtype is not None:
                raise PolicyError(
                    "dtype and opt-level overrides apply only when TrainStep initializes the "
                    "model; this optimizer was initialized already (with its own settings)."
                )
        else:
            # The step runs the loss under the forward's region, as torch.amp's loop does: at O1
            # the outputs reach it as computed (O1's fp32 outputs serve a loss outside).
            keep = (
                "cast_model_outputs" not in overrides and OptLevel.parse(opt_level) is OptLevel.O1
            )
            if keep:
                overrides = {**overrides, "cast_model_outputs": None}
            model, optimizer = initialize(model, optimizer, opt_level, dtype=dtype, **overrides)
            if keep:
                optimizer.options = optimizer.options.explained(
                    "cast_model_outputs", "TrainStep runs the loss in the forward's region"
                )
        # The one stream that warms up and captures (and DDP's construction stream: PyTorch's
        # rule 2 for capturing DDP). Until 2026-11-28 only DDP captured there; otherwise the
        # capture ran on torch.cuda.graph's own stream, after warming up on this one. On the
        # H200 run that step held about 130 MiB more than graph_step.py's hand-written capture,
        # which does both on one stream, at 0.4-1.2% more time; a second stream's library
        # workspaces and autograd's wait on the warm-up stream are the suspects (not measured).
        self._side: Any = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ddp_built = ddp_kwargs is not None
        if ddp_kwargs is not None:
            model = ddp_rules.wrap(model, ddp_kwargs, self._side)
        if isinstance(model, DistributedDataParallel):
            wrapping.register_replicated([model], [optimizer])
        self.model: nn.Module = model
        self.optimizer: AmpOptimizer = optimizer
        self.options = optimizer.options
        if scaler is not None:
            optimizer._scaling.scaler = scaler
            if optimizer.healer is not None:  # healing listens to the scaler that runs
                optimizer.healer.rebind(scaler)
        self._clip = None if clip_grad_norm is None else float(clip_grad_norm)
        self._user_loss = loss_from(loss_fn, compute_loss)
        self.amp_backend: Any = None
        self._forward_backend: CountingBackend | None = None
        self._device = device
        self.notes: list[str] = []
        # The whole step compiled: forward and loss here, everything after backward in
        # `StepUpdate` (built now, compiled at its first call, after the warm-up step).
        compile_kwargs = dict(compile) if isinstance(compile, dict) else {}
        one_graph = compile_kwargs.pop("one_graph", True)
        self._compile_blocked: str | None = None
        if whole and (isinstance(model, DistributedDataParallel) or is_initialized()):
            self._compile_blocked = (
                f"running eagerly: the compiled step does not place collectives yet (the same "
                f"operations run one at a time{self._collectives()})"
            )
            if capture == "compile":
                raise TrainStepError(
                    self._compile_blocked.replace("running eagerly: ", "cannot compile: ")
                )
            whole = False
        if whole and device.type != "cuda":
            layout_note = keep_weight_layouts(model, compile_kwargs)
            if layout_note is not None:
                self.notes.append(layout_note)
        self._compile_arg = compile_kwargs if whole else compile  # rebuild_forward's
        self._forward_dropped = 0  # forward graphs compiled before the last rebuild_forward
        self._loss = self._build_loss(self._compile_arg)
        self._eager_loss = self._build_loss(False) if whole else self._loss
        self._update: StepUpdate | None = None
        self._compile_checked = False
        self._hyper: Fingerprint | None = None  # hyperparameters at the last compiled update
        self._hyper_changes = 0
        self.compiled = False
        if whole:
            update_kwargs = {
                k: v for k, v in compile_kwargs.items() if k not in ("casts", "kernels")
            }
            self._update = StepUpdate(optimizer, self._clip, update_kwargs)
            for note in tensor_lr(optimizer.optimizer):
                self.notes.append(note)
        # The whole step as one graph (`mixprec.step.whole`), or why not.
        off = trace_flag()
        if not one_graph:
            off = "compile={'one_graph': False} was requested"
        elif not whole or self._update is None:
            off = "no compiled update"
        elif self._device.type == "cuda":
            off = "on CUDA the compiled step is recorded into a CUDA graph as it is"
        elif self._update.split:
            off = f"the update is more than one graph ({self._update.split})"
        self._one = OneGraph(off)
        if isinstance(model, DistributedDataParallel) and warmup < ddp_rules.DDP_WARMUP:
            warmup = ddp_rules.DDP_WARMUP
            self.notes.append(
                f"warmup={warmup} eager steps before capture (PyTorch's rule for capturing DDP: "
                f"at least {ddp_rules.DDP_WARMUP} DDP iterations first)"
            )
        self._warmup = warmup
        self._max_graphs = max_graphs
        self._backend: graphs.Backend = graphs.CudaGraphs(self._side)
        self._graphs: OrderedDict[Any, StepGraph] = OrderedDict()
        self._warm: dict[Any, int] = {}
        self._fingerprint: Fingerprint | None = None
        self._last: StepGraph | None = None
        self.captured = False
        self.calls = 0
        self.captures = 0
        self.capture_mode = capture
        self._blocked = self._initial_blocker(capture)
        self.reason = self._blocked or "not run yet"
        if self._blocked is None:
            self._prepare()
        if optimizer.healer is not None:  # heal=...: a module moved to fp32 changes the forward
            optimizer.healer.add_rebuild(self.rebuild_forward)

    # ------------------------------------------------------------------ set-up

    def _initial_blocker(self, capture: str) -> str | None:
        collectives = self._collectives()
        if capture == "eager":
            return "running eagerly: capture='eager' was requested"
        if self._device.type != "cuda" and self._compile_blocked is not None:
            return self._compile_blocked
        if self._device.type != "cuda":
            if self._update is None and self._compile_arg is False:
                return (
                    f"running eagerly: compile=False was requested (the same operations run "
                    f"one at a time{collectives}; on {self._device} the compiled step is what "
                    f"compile=None gives)"
                )
            return (
                f"running eagerly: CUDA graphs need a CUDA device and the model is on "
                f"{self._device} (the same operations run one at a time{collectives})"
            )
        why = ddp_rules.capture_blocker(self.model, self._device, self._ddp_built)
        if why is not None:
            message = f"running eagerly: {why}. The step computes the same numbers eagerly"
            if capture == "cuda_graph":
                raise TrainStepError(message.replace("running eagerly: ", "cannot capture: "))
            return message
        return None

    def _collectives(self) -> str:
        """How the step's collectives run, for reasons and explain() (empty when single-process)."""
        return ddp_rules.describe_collectives(self.model, self.optimizer, self._device)

    def _build_loss(self, compile: Any) -> Callable[..., torch.Tensor]:
        opts = self.options
        user = self._user_loss
        model: Any = self.model

        def plain(*batch: Any) -> torch.Tensor:
            return user(model, *batch)

        if compile or isinstance(compile, dict):
            # Model and loss in one compiled graph. O1 applies its policy to the whole captured
            # graph (mixprec.graph), losses included, which no function mode would see there;
            # mixprec.compile runs each call in the policy's region too, so that code dynamo
            # leaves to Python (a graph break) still follows the policy.
            kwargs = dict(compile) if isinstance(compile, dict) else {}
            kwargs.setdefault("dynamic", False)  # one graph per input signature, like capture
            forward = own_code(plain, "mixprec_trainstep_forward")
            if opts.patch_torch_functions:
                from mixprec.graph.backend import compile as amp_compile

                compiled = amp_compile(forward, policy=opts.policy, dtype=opts.dtype,
                                       device_type=opts.device_type, **kwargs)  # fmt: skip
                self.amp_backend = compiled.mixprec_backend
                return compiled
            kwargs.pop("casts", None)  # O2/O3: the model's own dtypes, no cast pass
            backend, kernels = kwargs.pop("backend", "inductor"), kwargs.pop("kernels", "auto")
            self._forward_backend = CountingBackend(backend, kernels=kernels)
            return torch.compile(forward, backend=self._forward_backend, **kwargs)
        if opts.patch_torch_functions:  # O1: the loss too runs under autocast, as in the loop
            from mixprec.eager.autocast import autocast

            def loss(*batch: Any) -> torch.Tensor:
                with autocast(opts.device_type, dtype=opts.dtype, policy=opts.policy):
                    return user(model, *batch)

            return loss
        return plain

    def rebuild_forward(self) -> None:
        """Build the forward and loss again with the opt level's current policy; drop the old
        compiled function and any captured graphs.

        Compiled code (and a captured CUDA graph) bakes the policy in, the modules kept in fp32
        included, and dynamo does not notice when a module's hooks change. Healing calls this
        once after a diagnosis that moved modules (and after loading a checkpoint whose moves
        differ); call it yourself after changing the model's fp32 modules by hand. Costs the
        next call a compilation (seconds) on the compiled path; nothing on the eager one.
        """
        self.options = self.optimizer.options
        if self.amp_backend is not None:
            self._forward_dropped += len(self.amp_backend.reports)
        elif self._forward_backend is not None:
            self._forward_dropped += self._forward_backend.compiles
        self.amp_backend = None
        self._forward_backend = None
        self._one.reset()  # rebuilt from the new forward
        compiled = self._eager_loss is not self._loss
        self._loss = self._build_loss(self._compile_arg)
        self._eager_loss = self._build_loss(False) if compiled else self._loss
        self._drop_graphs()
        self._fingerprint = None

    @property
    def healer(self) -> Any:
        """The `mixprec.Healer` of this step (``heal=True``); None without healing."""
        return self.optimizer.healer

    # ------------------------------------------------------------------ the step

    def _body(self, *batch: Any) -> torch.Tensor:
        opt = self.optimizer
        update = self._compiled_path()
        whole = self._one.pick(self, update)
        if whole is not None:
            try:
                loss = self._one.run(whole, batch)
            except MixprecError:
                raise
            except Exception as err:  # after its first run: this batch's error, as below
                raise BatchError(batch_message(self.model, batch, err, self._user_loss)) from (
                    trim(err)
                )
            if loss is not None:
                self.compiled = True
                return loss
        if update is not None:
            update.zero_grad()
        else:
            opt.zero_grad(set_to_none=True)
        forward = self._eager_loss if watcher_of(self.model) is not None else self._loss
        if update is not None and self._one.pending():
            # The steps before the whole step's first run the forward uncompiled: once the
            # optimizer's state exists the forward is compiled as part of the whole step, and
            # a separate compilation of it would only serve this step.
            forward = self._eager_loss
        try:
            loss = forward(*batch)
        except MixprecError:
            raise
        except Exception as err:  # the user's model or loss: say which batch element and why
            raise BatchError(batch_message(self.model, batch, err, self._user_loss)) from (
                trim(err)
            )
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            raise TrainStepError(_loss_problem(loss))
        if update is not None:
            # Backward through the compiled forward's own backward, then the rest of the step
            # as one compiled graph (`StepUpdate`), or eagerly when this step creates optimizer
            # state: the same operations as below either way.
            scaler = opt.scaler
            (scaler.scale(loss) if scaler is not None else loss).backward()
            self.compiled = self._update_allowed(update.ready())
            if self.compiled:
                update()
            else:
                update.eager()
            self._one.update_ran, self._one.last = self.compiled, False
            return loss.detach()
        with scale_loss(loss, opt) as scaled:
            scaled.backward()
        if self._clip is not None:
            torch.nn.utils.clip_grad_norm_(list(master_params(opt)), self._clip)
        opt.step()
        # The scale update belongs to this step (a captured graph must contain it), not to the
        # start of the next, where initialize's deferred update would put it.
        opt._scaling.flush()
        return loss.detach()

    def _compiled_path(self) -> StepUpdate | None:
        """The `StepUpdate` when this step takes the compiled path, else None (all eager)."""
        update = self._update
        if update is None or self._compile_blocked is not None:
            return None
        if watcher_of(self.model) is not None:
            return None
        return update

    def _update_allowed(self, ready: bool) -> bool:
        """Whether the compiled update runs this step, `ready` saying whether the optimizer's
        state exists for every parameter with a gradient.

        `StepUpdate.blocker` is asked at each step until the state exists, that one included: what
        it checks on the state (state kept as Python numbers) only shows once the state exists,
        but the rest (a ``skip_mode='sync'`` scaler, a closure) shows from the first step and
        must be named then, since some optimizers never report their state complete under
        such a blocker (SGD without momentum beside a sync scaler), and the reason would
        otherwise promise a compiled update forever. Cost: a pass over the parameters per step
        until the state exists. Then, every step, whether a hyperparameter the graph bakes in
        keeps changing."""
        if self._compile_checked:
            if self._compile_blocked is not None or not ready:
                return False
            why = self._hyperparameter_churn()
        else:
            self._compile_checked = ready
            why = StepUpdate.blocker(self.optimizer)
        if why is None:
            return ready
        self._compile_blocked = (
            f"compiled forward and backward, eager update: {why}, so the update after backward "
            f"cannot be compiled (its operations run one at a time)"
        )
        if self.capture_mode == "compile":
            raise TrainStepError(f"cannot compile the step: {why}.")
        return False

    def _hyperparameter_churn(self) -> str | None:
        """Why the update should stop being compiled: a hyperparameter held as a Python number
        (betas cycled by OneCycleLR, say) changed more often than recompiling is worth.

        Each change recompiles the update (dynamo guards on the value); past its limit of 8
        graphs dynamo would run the update uncompiled without telling. Cost: a pass over the
        param groups' entries (microseconds).
        """
        inner = self.optimizer.optimizer
        now = graphs.fingerprint(inner, self.model, None)
        before, self._hyper = self._hyper, now
        if before is None or before.hyperparameters == now.hyperparameters:
            return None
        self._hyper_changes += 1
        if self._hyper_changes < _CHURN:
            return None
        return (
            f"{before.diff(now)} changed in {self._hyper_changes} steps, and the compiled update "
            f"bakes Python numbers in (each change compiles it again); hold the value in a "
            f"0-dim tensor or keep it fixed to compile the update"
        )

    def __call__(self, *batch: Any) -> torch.Tensor:
        """Run one training step on `batch`; return the (unscaled) loss as a device tensor.

        Raises:
            BatchError: the model or the loss raised on this batch; the message names the
                batch element, its shape and the module that failed, with the model's own
                error, which is chained (``__cause__``) with its traceback from the user's code.
        """
        try:
            healer = self.healer
            if healer is None or not healer.replaying or _several_ranks():
                return self._call(batch)
            return self._call_replaying(healer, batch)
        except BatchError as err:
            # Re-raised here: the traceback shows the caller's line, not the step's machinery.
            raise err.with_traceback(None) from err.__cause__

    def _call_replaying(self, healer: Any, batch: tuple[Any, ...]) -> torch.Tensor:
        """A step while healing diagnoses (``HealConfig.replay``): the healer keeps a copy of
        each batch whose skip an overflow explains, with the random number generators' states
        the step started from; after a move, those steps run again with the module in fp32,
        oldest first, drawing the same random numbers (dropout masks) as their first attempt,
        so the move costs no update and the run continues as one that kept the module in fp32
        from the start. Returns the loss of the last step run: this batch's, replayed or not."""
        queue: list[tuple[tuple[Any, ...], Any]] = [(batch, None)]
        loss = None
        while queue:
            current, rng = queue.pop(0)
            if rng is not None:
                _set_rng(rng)
            held = (_copy_batch(current), _get_rng(self._device)) if healer.replaying else None
            healer.hold(held)
            try:
                loss = self._call(current)
            finally:
                healer.hold(None)
            queue += healer.take_replays()
        assert loss is not None
        return loss

    def _call(self, batch: tuple[Any, ...]) -> torch.Tensor:
        self.calls += 1
        self.compiled = False
        if self._update is not None and (self._device.type != "cuda" or self._blocked):
            return self._compiled_call(batch)
        if self._blocked is not None:
            return self._eager(batch, self._blocked)
        if watcher_of(self.model) is not None:
            self._drop_graphs()
            return self._eager(batch, (
                "running eagerly: a mixprec.watch_nonfinite is active on the model, and its "
                "hooks run Python on every call, which a replayed CUDA graph would skip"
            ))  # fmt: skip
        signature, why = graphs.batch_signature(batch, self._device)
        if signature is None:
            return self._eager(batch, "running eagerly: " + why)
        current = self._current_fingerprint()
        if self._fingerprint is not None and current != self._fingerprint:
            # Changed between calls (an LR schedule, a loaded state dict, frozen layers): every
            # graph baked the old values in.
            what = self._fingerprint.diff(current)
            self._drop_graphs()
            return self._eager(batch, (
                f"running eagerly: {what} changed since the last step, and a captured graph "
                f"bakes these in; re-capturing after {self._warmup} steps without changes"
            ), signature)  # fmt: skip
        entry = self._graphs.get(signature)
        if entry is None:
            seen = self._warm.get(signature, 0)
            if seen < self._warmup:
                return self._eager(batch, (
                    f"warming up: eager step {seen + 1} of {self._warmup} for input "
                    f"{graphs.describe_signature(signature)} before capture"
                ), signature)  # fmt: skip
            if self._creates_state():
                return self._eager(batch, (
                    f"warming up: the optimizer has not created its state for every parameter "
                    f"yet (each step so far overflowed and was skipped, or parameters were "
                    f"added); the step that creates it is decided on the host, which a CUDA "
                    f"graph cannot record, so it runs eagerly and input "
                    f"{graphs.describe_signature(signature)} is captured after it"
                ), signature)  # fmt: skip
            entry = self._capture(batch, signature)
            if entry is None:
                return self._eager(batch, self.reason)
            self.captured = True
            self.reason = (f"captured a CUDA graph for input {graphs.describe_signature(signature)}"
                           f" and ran it")  # fmt: skip
            if self._backend.executes_on_capture:
                return entry.loss.detach().clone()
            # Recording ran the step's Python (the scaler counted its update) but no kernels.
            return entry.replay(self._backend, restore_grads=False)
        else:
            self._graphs.move_to_end(signature)
            entry.load(batch)
        loss = entry.replay(self._backend, restore_grads=self._last is not entry)
        self._last = entry
        self.captured = True
        self.reason = (
            f"replaying the CUDA graph captured for input {graphs.describe_signature(signature)}"
        )
        self._note_replayed_update()
        return loss

    def _compiled_call(self, batch: tuple[Any, ...]) -> torch.Tensor:
        """A step of the compiled path (no CUDA graph): compiled, or eager with the reason."""
        compiles = self.graphs_compiled
        loss = self._eager(batch, "")
        if self.compiled:
            what = ("compiled the whole step and ran it" if self.graphs_compiled > compiles
                    else "ran the compiled step")  # fmt: skip
            self.reason = f"{what}: {self._compiled_summary()}"
        elif watcher_of(self.model) is not None:
            self.reason = (
                "running eagerly: a mixprec.watch_nonfinite is active on the model, and its "
                "hooks run Python on every call, which compiled code would trace once"
            )
        elif self._compile_blocked is not None:
            self.reason = self._compile_blocked
        elif self._one.off is None:
            self.reason = (
                "this step runs eagerly: it creates optimizer state (decided on the host, so "
                "that a skipped first step creates none); from the next step the whole step, "
                "forward to update, runs as one compiled graph"
            )
        else:
            self.reason = (
                "compiled forward and backward, eager update: this step creates optimizer state "
                "(decided on the host, so that a skipped first step creates none); the update "
                "is compiled from the next step"
            )
        return loss

    def _compiled_summary(self) -> str:
        level = self.options.level.value
        forward = (
            f"forward and loss under the {level} policy"
            if self.options.patch_torch_functions
            else f"forward and loss ({level} model)"
        )
        parts = [forward, "backward"]
        if self.optimizer._low:
            parts.append("gradients into the fp32 masters")
        if self.optimizer.scaler is not None and self.optimizer.scaler.is_enabled():
            parts.append("unscale and overflow check")
        if self._clip is not None:
            parts.append(f"clipping to norm {self._clip:g}")
        name = type(self.optimizer.optimizer).__name__
        parts.append(f"{name} with an exact skip on overflow"
                     if self.optimizer.scaler is not None and self.optimizer.scaler.is_enabled()
                     else name)  # fmt: skip
        if self.optimizer._low:
            parts.append("masters copied into the model")
        if self.optimizer.scaler is not None and self.optimizer.scaler.is_enabled():
            parts.append("scale update")
        how = " (one graph)" if self._one.last else ""
        return ", ".join(parts) + f"{how} ({self.graphs_compiled} graphs compiled so far)"

    @property
    def graphs_compiled(self) -> int:
        """Graphs compiled for this step so far: forward graphs and update graphs (a count that
        grows after warm-up means recompilation: a new input shape, or a changed setting)."""
        forward = (
            len(self.amp_backend.reports)
            if self.amp_backend is not None
            else (self._forward_backend.compiles if self._forward_backend is not None else 0)
        )
        forward += self._forward_dropped  # compiled before a rebuild_forward
        return forward + (self._update.compiles if self._update is not None else 0)

    def _note_replayed_update(self) -> None:
        scaler = self.optimizer.scaler
        if scaler is not None:
            scaler.note_update()  # count the replayed scale update, for on_skip reporting

    def _current_fingerprint(self) -> Fingerprint:
        return graphs.fingerprint(self.optimizer.optimizer, self.model, self.optimizer.scaler)

    def _eager(self, batch: tuple[Any, ...], reason: str, signature: Any = None) -> torch.Tensor:
        self.captured = False
        self.reason = reason
        self._last = None
        if signature is None or self._device.type != "cuda":
            loss = self._body(*batch)
        else:
            # Warm-up on a side stream, as PyTorch's whole-network capture recipe asks: the
            # capture that follows then starts from a clean stream state.
            main = torch.cuda.current_stream(self._device)
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                loss = self._body(*batch)
            main.wait_stream(self._side)
        if signature is not None:
            self._warm[signature] = self._warm.get(signature, 0) + 1
            # The first steps create optimizer and scaler state: compare later calls with the
            # state as this step left it.
            self._fingerprint = self._current_fingerprint()
        return loss

    def _creates_state(self) -> bool:
        """Whether the next step may create optimizer state (fp16 runs whose every step so far
        overflowed). Cost: a pass over the parameters until the state exists."""
        scaler = self.optimizer.scaler
        if scaler is None or not scaler.is_enabled():
            return False  # no skipped steps: the first eager step created the state
        inner = self.optimizer.optimizer
        return scaler._guard(inner).creates_state(inner)

    def _capture(self, batch: tuple[Any, ...], signature: Any) -> StepGraph | None:
        blocker = graphs.capture_blocker(self.optimizer.optimizer, self._device)
        if blocker is not None:
            self._block(blocker)
            return None
        params = list(self.model.parameters()) + list(master_params(self.optimizer))
        try:
            entry = StepGraph.record(self._backend, self._body, batch, signature, params)
        except Exception as err:  # any capture failure means: run eagerly
            self._reset_after_failed_capture()
            self._block(f"capture failed ({type(err).__name__}: {err})".replace("\n", " "))
            return None
        self.captures += 1
        self._graphs[signature] = entry
        while len(self._graphs) > self._max_graphs:
            self._graphs.popitem(last=False)
        self._last = entry
        return entry

    def _block(self, why: str) -> None:
        message = (
            f"running eagerly: {why}. The step computes the same numbers eagerly; only the "
            f"launch overhead remains"
        )
        if self.capture_mode == "cuda_graph":
            raise TrainStepError(message.replace("running eagerly: ", "cannot capture: "))
        self._blocked = message
        self.reason = message
        self._drop_graphs()

    def _reset_after_failed_capture(self) -> None:
        # A failed recording ran the step's Python but none of its kernels: forget the
        # half-finished iteration (gradients, the scaler's stage machine) before the eager step.
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer._scaling.pending = False
        self.optimizer._scaling.flush()
        scaler = self.optimizer.scaler
        if scaler is not None:
            scaler._per_optimizer.clear()
            scaler._already_unscaled.clear()
            scaler._block_found.clear()
            for loss in scaler._losses or ():
                loss.found_inf = None
                loss.replicas.clear()

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._warm.clear()
        self._last = None

    # ------------------------------------------------------------------ introspection

    @property
    def scaler(self) -> GradScaler | None:
        """The loss scaler (None when the opt level does not scale)."""
        return self.optimizer.scaler

    def explain(self) -> str:
        """How this step runs: opt level, compilation and capture state with the reasons,
        the kernel chosen for each heavy op, automatic changes."""
        how = "captured" if self.captured else "compiled" if self.compiled else "eager"
        lines = [
            f"TrainStep: {self.options.level.value}, {str(self.options.dtype).split('.')[-1]} on "
            f"{self._device}, capture={self.capture_mode!r}",
            f"  calls: {self.calls}, captures: {self.captures}, cached graphs: "
            f"{len(self._graphs)} of {self._max_graphs}",
            f"  last call: {how}: {self.reason}",
        ]
        if self._update is not None:
            update = self._update
            forward = self.graphs_compiled - update.compiles
            whole = self._one.whole.compiles if self._one.whole is not None else 0
            forward -= whole
            lines.append(
                f"  compiled graphs: {self.graphs_compiled} ({forward} forward+loss, whose "
                f"backward AOTAutograd compiles with it; {update.compiles} for the update after "
                f"backward{'' if update.split is None else ': ' + update.split}; {whole} for "
                f"the whole step as one graph)"
            )
            lines.append(f"  one graph: {self._one.describe()}")
            if self._compile_blocked is not None:
                lines.append(f"  not compiled: {self._compile_blocked}")
        if self.amp_backend is not None:
            choices = self.amp_backend.kernel_choices
        else:
            choices = self._forward_backend.kernel_choices if self._forward_backend else []
        if choices:
            from mixprec.graph.kernels import summary

            lines.append("  kernels (measured on this machine):")
            lines += ["    " + line for line in summary(choices).splitlines()]
        if is_initialized():
            lines.append(f"  distributed:{self._collectives()[1:]}")
        lines += [f"  changed: {note}" for note in self.notes]
        if self.healer is not None:
            lines += ["  " + line for line in self.healer.report().splitlines()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"TrainStep({self.options.level.value}, {type(self.model).__name__}, "
                f"captured={self.captured}, compiled={self.compiled})")  # fmt: skip

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer (masters, scaler included). Synchronises with the device."""
        return {
            "format": FORMAT,
            "model": self.model.state_dict(),
            "optimizer": _host_lr(self.optimizer.state_dict()),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict`` wrote. Checked before anything changes; graphs re-captured."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
            raise TrainStepError(
                f"not a TrainStep state dict (expected format {FORMAT!r}); load the model's and "
                f"optimizer's own state dicts into step.model and step.optimizer instead."
            )
        own = self.model.state_dict()
        theirs = state_dict.get("model")
        if (
            not isinstance(theirs, dict)
            or set(theirs) != set(own)
            or any(
                not isinstance(theirs[k], torch.Tensor) or theirs[k].shape != own[k].shape
                for k in own
            )
        ):
            raise TrainStepError(
                "the state dict's model entries do not match this model (names or shapes "
                "differ); nothing was loaded."
            )
        self.optimizer.load_state_dict(state_dict.get("optimizer"))  # validates, then commits
        self.model.load_state_dict(theirs)
        self._drop_graphs()
        self._fingerprint = None
        if self._update is not None:
            # The loaded param groups hold the lr as a float (checkpoints are portable); the
            # compiled update reads it as a tensor, as before the save: the same fp32 value
            # then enters the same arithmetic (a float lr is another constant in the graph,
            # and the resumed run drifted from the uninterrupted one by an fp32 rounding).
            tensor_lr(self.optimizer.optimizer)
        if self._blocked is None:
            self._prepare()

    def _prepare(self) -> None:
        for note in graphs.prepare(self.optimizer.optimizer, self._device):
            if note not in self.notes:
                self.notes.append(note)


def _refuse_several_losses(scaler: Any, optimizer: Any, overrides: dict[str, Any]) -> None:
    """Raise where the step would run under a scaler with several loss scales.

    Checked before ``initialize`` touches the model, so that a corrected call can follow.
    """
    # The scaler that will run: the one given replaces the optimizer's.
    if scaler is not None:
        n = scaler._num_losses
        where = f"a scaler with num_losses={n}"
    elif isinstance(optimizer, AmpOptimizer):
        own = optimizer.scaler
        n = own._num_losses if own is not None else 1
        where = f"an optimizer initialized with num_losses={n}"
    else:
        n = overrides.get("num_losses", 1)
        where = f"num_losses={n!r}"
    if isinstance(n, int) and n > 1:
        raise TrainStepError(
            f"TrainStep got {where}, and a TrainStep trains one loss: "
            f"each of several losses needs its own scaled backward and unscale "
            f"(scaler.scaled(loss, optimizer, loss_id=i)), which a step that computes one "
            f"loss has no place for. Sum the losses into one (compute_loss=lambda model, x, "
            f"y: loss_a + loss_b) with a one-loss scaler, or write the loop with "
            f"mixprec.initialize(..., num_losses={n}) and one scaler.scaled block per loss."
        )


def _loss_problem(loss: Any) -> str:
    """Why `loss` cannot be the step's loss, and the fix."""
    head = "the loss must be a one-element tensor that requires grad; got "
    if not isinstance(loss, torch.Tensor):
        return (
            f"{head}{type(loss).__name__}. Return only the loss tensor from loss_fn or "
            f"compute_loss (a step returns the loss alone; compute metrics from its output or "
            f"with step.model outside the step)."
        )
    if loss.numel() != 1:
        return f"{head}a tensor of shape {tuple(loss.shape)}. Reduce it (e.g. .mean())."
    return (
        f"{head}a one-element tensor that does not require grad: the step ran under "
        f"torch.no_grad() or torch.inference_mode() (call it outside), or no parameter the "
        f"loss depends on requires grad (a frozen model: unfreeze what should train)."
    )


#: torch.compile's keyword arguments (what a ``compile=`` dict may hold besides mixprec's).
COMPILE_KEYS = tuple(k for k in inspect.signature(torch.compile).parameters if k != "model")


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise PolicyError("TrainStep needs a model with parameters to train.")


def _host_lr(state: dict[str, Any]) -> dict[str, Any]:
    # A device lr (set for capture) is saved as a float, so the checkpoint loads anywhere.
    groups = state.get("param_groups", [])
    for group in groups:
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
    return state


def _copy_batch(batch: tuple[Any, ...]) -> tuple[Any, ...]:
    """The batch with every tensor copied: a data loader may refill its buffers in place
    before a held batch is replayed."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, batch)


def _several_ranks() -> bool:
    """Replay is off across processes: each rank decides its moves from its own batches'
    overflows, and a replayed step is a collective that every rank would have to run."""
    return is_initialized() and torch.distributed.get_world_size() > 1


def _get_rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.device]:
    """The default generators' states (CPU, and the step's CUDA device): host copies, no sync."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, device


def _set_rng(state: tuple[torch.Tensor, torch.Tensor | None, torch.device]) -> None:
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
