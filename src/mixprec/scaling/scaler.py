"""`GradScaler`: dynamic loss scaling that never waits for the device.

A drop-in for ``torch.amp.GradScaler`` (same constructor, methods and default trajectory) built
as a thin shell around the pure update in `mixprec.scaling.state`:

- ``scale``, ``unscale_``, ``step`` and ``update`` never synchronise with the device. Unscaling
  and the finite check run as one fused pass per (device, dtype) group; the skip decision
  is applied on the device (`mixprec.scaling.skip`); the scale update is a handful of tensor ops.
- Each optimizer goes through a stage machine, ready -> unscaled -> stepped, reset by
  ``update()``; calls out of order raise an error naming the rule they break.
- Under ``torch.distributed`` the overflow count is all-reduced (asynchronously, MAX) before any
  rank decides, so all ranks skip together and their scales stay equal. Where DDP already
  all-reduced every gradient an optimizer steps, that collective is redundant and skipped
  (`mixprec.distributed.agreement` says when). DTensor gradients (FSDP2) are unscaled and
  checked as local shards, so DTensor adds no collective of its own.
- ``state_dict`` carries every field (scale, trackers, counters, config, per-loss scales) and
  loads torch.amp's format; a bad state dict is refused before anything changes.
- Optimizers that handle scaling themselves get torch's contracts (`mixprec.scaling.contract`):
  fused ones the ``grad_scale``/``found_inf`` attributes, older ones ``grad_scaler=self``.

Reading values back (``get_scale``, ``state_dict``, ``stats``, ``last_step_skipped``,
``explain``) synchronises, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from mixprec._compat import capturing, dynamo_tracing
from mixprec.errors import MixprecError, PolicyError
from mixprec.scaling import checkpoint, contract, report
from mixprec.scaling.report import SkipEvent
from mixprec.scaling.skip import SkipMode, StepGuard, choose_mode
from mixprec.scaling.state import (
    ScaleConfig,
    ScalerConfigError,
    ScaleState,
    checked_new_scale,
    choice,
    init_state,
    is_int,
    is_number,
    update_scale,
    update_scale_,
    updates_in_place,
)
from mixprec.scaling.unscale import (
    IMPLS,
    Fp16GradientError,
    check_finite_,
    group_grads,
    unscale_and_check_,
)

__all__ = ["GradScaler", "ScalerStateError", "SkipEvent"]


class ScalerStateError(MixprecError, RuntimeError):
    """A GradScaler method was called out of order (the message names the rule)."""


def _check_has_grads(optimizer: torch.optim.Optimizer) -> None:
    """Raise where no parameter of `optimizer` has a gradient: no overflow check can be made,
    and a step counted as clean would grow the scale on no evidence (torch.amp's GradScaler
    raises too: "No inf checks were recorded for this optimizer"). Stops at the first gradient,
    so a normal step pays for one or two attribute reads."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return
    raise ScalerStateError(
        "step(optimizer) found no gradient in any of the optimizer's parameters, so there is "
        "nothing to check for overflow or to step (torch.amp raises 'No inf checks were "
        "recorded for this optimizer' here). Call scaler.scale(loss).backward() before "
        "scaler.step(optimizer); if optimizer.zero_grad() (set_to_none=True) runs between "
        "backward and step, move it before the forward pass or after update()."
    )


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _PerOptimizer:
    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None  # on the scale's device, summed over devices
    pending: Any = None  # an async all-reduce handle to wait on before using found_inf


@dataclass
class _Loss:
    """One loss scale: its state and the per-device copies of its scale for this iteration."""

    state: ScaleState
    replicas: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    found_inf: torch.Tensor | None = None  # overflows of this loss's backward (num_losses > 1)

    def scale_on(self, device: torch.device) -> torch.Tensor:
        if device == self.state.scale.device:
            return self.state.scale
        rep = self.replicas.get(device)
        if rep is None:
            rep = self.replicas[device] = self.state.scale.to(device, non_blocking=True)
        return rep


class GradScaler:
    """Dynamic loss scaling without host-device synchronisation. A drop-in for torch.amp's.

    Args:
        device: device type the scaled tensors live on (``'cuda'``, ``'cpu'``, ...).
        init_scale: the starting scale.
        growth_factor: scale *= growth_factor after `growth_interval` clean steps.
        backoff_factor: scale *= backoff_factor on an overflow.
        growth_interval: clean steps between growths.
        enabled: False makes every method a no-op (``scale`` returns its input, ``step`` calls
            ``optimizer.step()``).
        hysteresis: overflows tolerated before backing off (Megatron-LM; 1 = torch).
        consecutive_hysteresis: refill the hysteresis budget on every clean step (DeepSpeed).
        min_scale: never back off below this. max_scale: never grow above this.
        dynamic: False keeps the scale fixed at `init_scale` (overflowing steps still skip).
        num_losses: independent scales for several losses (Apex's ``num_losses``); use
            :meth:`scaled` around each loss's backward.
        skip_mode: ``'auto'`` (fused optimizers skip in their kernel, others by
            snapshot-and-restore on the device), ``'restore'``, ``'sync'`` (torch's way: one
            host sync per step) or ``'fused'``. See `mixprec.scaling.skip`.
        unscale_impl: ``'auto'``/``'torch'`` (torch's fused unscale-and-check kernel, one pass) or
            ``'foreach'`` (mixprec's multi-tensor composition; see `mixprec.scaling.unscale`).
        process_group: the group whose ranks must agree on skipping (default: the world, when
            ``torch.distributed`` is initialized).
        on_skip: called with a :class:`SkipEvent` for each overflowing update, in batches of
            `check_every` updates; each batch costs one host sync. None: never sync for this.
        check_every: updates between ``on_skip`` checks.

    Example::

        scaler = mixprec.GradScaler("cuda")
        for x, y in data:
            optimizer.zero_grad()
            with mixprec.autocast("cuda"):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)                    # optional, e.g. to clip
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)                       # skipped on the device on overflow
            scaler.update()

    With ``dynamic=True``, an `init_scale` outside ``[min_scale, max_scale]`` is moved inside,
    as Apex does; ``explain()`` lists that and every other automatic decision.

    Raises:
        ScalerConfigError: an argument is invalid (the message names it, the valid values and,
            for misspellings, the closest one).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float | None = None,
        dynamic: bool = True,
        num_losses: int = 1,
        skip_mode: str = "auto",
        unscale_impl: str = "auto",
        process_group: Any = None,
        on_skip: Callable[[SkipEvent], None] | None = None,
        check_every: int = 100,
    ) -> None:
        from mixprec.dtypes import parse_device_type

        try:
            self._device = parse_device_type(device)
        except PolicyError as err:
            raise ScalerConfigError(f"GradScaler device={device!r}: {err}") from None
        if not (isinstance(enabled, bool) or (is_int(enabled) and enabled in (0, 1))):
            raise ScalerConfigError(
                f"GradScaler enabled={enabled!r} is not a bool: pass True or False (torch would "
                f"treat any non-empty string, 'False' included, as True)."
            )
        enabled = bool(enabled)
        if not (is_number(init_scale) and 0.0 < init_scale < math.inf):
            raise ScalerConfigError(
                f"GradScaler init_scale={init_scale!r} must be a finite number > 0 (2.0**16 is "
                f"torch's default)."
            )
        self._config = ScaleConfig(
            growth_factor, backoff_factor, growth_interval, hysteresis,
            consecutive_hysteresis, min_scale, max_scale, dynamic,
        )  # fmt: skip
        if not (is_int(num_losses) and num_losses >= 1):
            raise ScalerConfigError(f"GradScaler num_losses={num_losses!r} must be an int >= 1.")
        self._skip_mode = SkipMode(choice("skip_mode", skip_mode, [m.value for m in SkipMode]))
        unscale_impl = choice("unscale_impl", unscale_impl, IMPLS)
        if on_skip is not None and not callable(on_skip):
            raise ScalerConfigError(
                f"GradScaler on_skip={on_skip!r} must be a callable taking a SkipEvent, or None."
            )
        if not (is_int(check_every) and check_every >= 1):
            raise ScalerConfigError(f"GradScaler check_every={check_every!r} must be an int >= 1.")
        self._notes: list[str] = []  # automatic decisions, with their reasons (explain())
        if enabled and self._device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "mixprec.GradScaler('cuda') is enabled but CUDA is not available; the scaler is "
                "disabled. Use GradScaler('cpu') to scale on the CPU.",
                stacklevel=2,
            )
            self._notes.append("disabled: created for 'cuda', and CUDA is not available")
            enabled = False
        init_scale = float(init_scale)
        cfg = self._config
        if cfg.dynamic and cfg.max_scale is not None and init_scale > cfg.max_scale:
            self._notes.append(f"init_scale {init_scale:g} lowered to max_scale "
                               f"{cfg.max_scale:g} (Apex does the same)")  # fmt: skip
            init_scale = cfg.max_scale
        if cfg.dynamic and cfg.min_scale is not None and init_scale < cfg.min_scale:
            self._notes.append(f"init_scale {init_scale:g} raised to min_scale "
                               f"{cfg.min_scale:g} (Apex does the same)")  # fmt: skip
            init_scale = cfg.min_scale
        self._enabled = enabled
        self._init_scale = init_scale
        self._num_losses = num_losses
        self._unscale_impl = unscale_impl
        self._process_group = process_group
        self._on_skip = on_skip
        self._listeners: list[Callable[[SkipEvent], None]] = []  # add_skip_listener (diagnostics)
        self._report_listeners: list[Callable[[int], None]] = []  # add_report_listener (healing)
        self._check_every = check_every
        self._reported_steps = 0  # updates already reported to on_skip (device count)
        self._unchecked = 0  # updates since the last on_skip check (host count, no sync)
        self._host_updates = 0  # updates so far, counted on the host (= the device's `steps`)
        self._losses: list[_Loss] | None = None  # created on first use, on the data's device
        # Loss fields to create the state from (a loaded or unpickled checkpoint), in
        # checkpoint._loss_entry's form: floats, NaN for unwritten history slots.
        self._pending_load: list[dict[str, Any]] | None = None
        self._per_optimizer: dict[int, _PerOptimizer] = {}
        self._guards: dict[int, StepGuard] = {}
        self._already_unscaled: set[int] = set()  # optimizers whose grads scaled() unscaled
        self._block_found: dict[int, torch.Tensor] = {}  # their overflows, from those blocks
        self._deferred: dict[int, torch.Tensor] = {}  # optimizers that unscale themselves

    # ------------------------------------------------------------------ state on the device

    def _ensure(self, device: torch.device) -> list[_Loss]:
        if self._losses is None:
            if device.type != self._device:
                raise ScalerStateError(
                    f"GradScaler(device={self._device!r}) was given a tensor on {device}; create "
                    f"the scaler with device={device.type!r}."
                )
            losses = []
            for fields in self._pending_load or [{} for _ in range(self._num_losses)]:
                fields = dict(fields)
                history = fields.pop("history", None)
                state = init_state(fields.pop("scale", self._init_scale), self._config, device,
                                   **fields)  # fmt: skip
                if history is not None:  # floats, NaN where unwritten (checkpoint._loss_entry)
                    state.history.copy_(torch.tensor(history, dtype=torch.float32))
                losses.append(_Loss(state))
            self._losses = losses
            self._pending_load = None
        return self._losses

    def _main_device(self) -> torch.device:
        if self._losses is None:
            raise ScalerStateError(
                "the scaler has not scaled anything yet: call scaler.scale(loss) before "
                "unscale_(), step() or update()."
            )
        return self._losses[0].state.scale.device

    # ----------------------------------------------------------------------------- scaling

    @overload
    def scale(self, outputs: torch.Tensor, loss_id: int = 0) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor], loss_id: int = 0) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...], loss_id: int = 0) -> tuple: ...
    def scale(self, outputs, loss_id=0):
        """Multiply a loss (or a nested list/tuple of them) by the scale. No sync.

        Args:
            outputs: tensors to scale.
            loss_id: which loss scale to use (``0 <= loss_id < num_losses``).
        """
        if not self._enabled:
            return outputs
        self._check_loss_id(loss_id)

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                loss = self._ensure(value.device)[loss_id]
                return value * loss.scale_on(value.device)
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
                return map(apply, value)  # as torch: other iterables come back as an iterator
            hint = (" (a dict: scale its loss, e.g. scaler.scale(out['loss']))"
                    if isinstance(value, Mapping) else "")  # fmt: skip
            raise TypeError(
                f"GradScaler.scale expects a tensor or a list/tuple of tensors, got "
                f"{type(value).__name__}{hint}."
            )

        return apply(outputs)

    def _check_loss_id(self, loss_id: int) -> None:
        if not (is_int(loss_id) and 0 <= loss_id < self._num_losses):
            raise ScalerConfigError(
                f"loss_id={loss_id!r} is not valid: this scaler has num_losses="
                f"{self._num_losses}, so loss_id must be an int in 0..{self._num_losses - 1}."
            )

    @contextlib.contextmanager
    def scaled(
        self,
        loss: torch.Tensor,
        optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer],
        loss_id: int = 0,
    ) -> Iterator[torch.Tensor]:
        """Scale one of several losses by its own scale; unscale its gradients on exit.

        Use with ``num_losses > 1`` (Apex's per-loss scaling)::

            with scaler.scaled(loss_a, optimizer, loss_id=0) as s:
                s.backward()
            with scaler.scaled(loss_b, optimizer, loss_id=1) as s:
                s.backward()
            scaler.step(optimizer)
            scaler.update()

        With one loss, gradients accumulated before the block stay where they are, multiplied
        by the scale, so the backward adds ``scale * g`` to them and the sum is unscaled and
        checked on exit. They must stay in place: under DDP's ``no_sync()`` the earlier
        micro-batches' gradients are local, and the first synchronised backward all-reduces
        whatever ``.grad`` holds (set aside, each rank kept its own and the replicas drifted
        apart). Cost: one multiply of the earlier gradients per block after the first (exact
        for the power-of-two scales the dynamic scaler keeps; a static scale that is not a
        power of two may move them by an ulp). With several losses or optimizers the earlier
        gradients are set aside and added back instead, so that each block's overflow is
        charged to its own loss and optimizers only (cost: one extra gradient buffer while the
        block runs); that does not combine with DDP's ``no_sync()``. A backward that raises
        leaves the earlier gradients as they were, unless it had already added to them.

        An overflow skips the step of the optimizers passed to the block that saw it, and only
        theirs (as Apex's ``scale_loss``; as torch's scaler, whose skip is per optimizer): with
        two optimizers and two blocks, an overflow in the first optimizer's block leaves the
        second optimizer stepping.
        """
        if not self._enabled:
            yield loss
            return
        self._check_loss_id(loss_id)
        opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        for opt in opts:
            contract.check_optimizer(opt, "scaled")
        for opt in opts:
            if self._peek(opt).stage is not _Stage.READY:
                raise ScalerStateError(
                    "scaler.scaled(...) was used after unscale_() or step() in the same "
                    "iteration; all backward passes of an iteration come before unscaling."
                )
        params = [p for opt in opts for g in opt.param_groups for p in g["params"]]
        scaled = self.scale(loss, loss_id)
        entry = self._ensure(loss.device)[loss_id]
        # fp16 gradients of an optimizer that takes the scale itself (mixprec's low-memory
        # optimizers) stay scaled: unscaled in fp16 they would lose their small values; the
        # optimizer divides them by the scale in fp32 at step() (`_deferred`). Earlier ones
        # are scaled already (`scaled_already`), so the block's add to them as they are.
        scaled_already = {
            id(p) for o in opts if self._defers(o) for g in o.param_groups for p in g["params"]
        }
        alone = len(opts) == 1 and set(self._per_optimizer) <= {id(opts[0])}
        if self._num_losses == 1 and alone:
            earlier = [p.grad for p in params if p.grad is not None and id(p) not in scaled_already]
            stash: dict[int, torch.Tensor] = {}
            self._rescale(earlier, entry.state.scale)
        else:
            # Several losses or optimizers: each block's overflow must be told apart from an
            # earlier block's (one loss's scale backs off, one optimizer skips, not the
            # others), so earlier gradients are set aside and added back (which does not
            # combine with DDP's no_sync: docs/distributed.md).
            earlier = []
            stash = {id(p): p.grad for p in params if p.grad is not None}
            for p in params:
                p.grad = None
        try:
            yield scaled
        except BaseException:
            self._rescale(earlier, self._inv_scale(entry, entry.state.scale.device))
            for p in params:  # a failed backward: put set-aside gradients back untouched
                if id(p) in stash:
                    p.grad = stash[id(p)]
            raise
        deferring = [opt for opt in opts if self._defers(opt)]
        kept = {id(p) for opt in deferring for g in opt.param_groups for p in g["params"]}
        groups = group_grads(p for p in params if id(p) not in kept)
        checked = group_grads((p for p in params if id(p) in kept), allow_fp16=True)
        main = entry.state.scale.device
        block = torch.zeros((), dtype=torch.float32, device=main)  # this block's overflows
        for device in {*groups, *checked}:
            inv = self._inv_scale(entry, device)
            found = torch.zeros((), dtype=torch.float32, device=device)
            for grads in groups.get(device, {}).values():
                unscale_and_check_(grads, inv, found, self._unscale_impl)
            for grads in checked.get(device, {}).values():
                check_finite_(grads, found)
            block = block + found.to(main, non_blocking=True)
        for opt in deferring:
            self._deferred[id(opt)] = entry.state.scale
        # Charged to the loss (its scale; the loss ran even without gradients) and to the
        # optimizers of this block (their skip).
        entry.found_inf = block if entry.found_inf is None else entry.found_inf + block
        for opt in opts:
            seen = self._block_found.get(id(opt))
            self._block_found[id(opt)] = block if seen is None else seen + block
        for p in params:
            old = stash.get(id(p))
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)
        for opt in opts:
            self._state(opt).stage = _Stage.READY  # still ready: the next unscale is a no-op
            self._already_unscaled.add(id(opt))

    @staticmethod
    def _rescale(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
        """Multiply `grads` in place by `factor` (a device scalar), grouped by device and dtype;
        sparse gradients one by one. No sync."""
        by: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            if g.is_sparse:
                g.mul_(factor.to(g.device, non_blocking=True))
            else:
                by.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by.items():
            torch._foreach_mul_(group, factor.to(device, non_blocking=True))

    def _defers(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer`'s gradients stay scaled after a `scaled` block: it holds fp16
        gradients, takes ``grad_scale`` itself (torch's fused contract, which its skip mode
        uses) and there is one loss (one scale for all its gradients)."""
        if self._num_losses != 1 or not contract.consumes_scale_attributes(optimizer):
            return False
        if self._guard(optimizer).mode is not SkipMode.FUSED:
            return False
        return any(p.grad is not None and p.grad.dtype == torch.float16
                   for g in optimizer.param_groups for p in g["params"])  # fmt: skip

    def _inv_scale(self, loss: _Loss, device: torch.device) -> torch.Tensor:
        # fp32 division can round differently under some compile settings: take the reciprocal
        # in fp64, as torch does, so both scalers unscale to the same bits.
        return loss.scale_on(device).double().reciprocal().float()

    # ----------------------------------------------------------------- unscale / step / update

    def _state(self, optimizer: torch.optim.Optimizer) -> _PerOptimizer:
        return self._per_optimizer.setdefault(id(optimizer), _PerOptimizer())

    def _peek(self, optimizer: torch.optim.Optimizer) -> _PerOptimizer:
        # The optimizer's iteration state without recording it: a call that fails its checks
        # must leave the scaler as it was (able to pickle, save, start the iteration again).
        return self._per_optimizer.get(id(optimizer)) or _PerOptimizer()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, counting non-finite ones. No sync.

        Optional: call it to inspect or clip gradients between ``backward`` and ``step``; ``step``
        unscales otherwise. Once per optimizer per iteration, after the last backward.
        """
        if not self._enabled:
            return
        contract.check_optimizer(optimizer, "unscale_")
        stage = self._peek(optimizer).stage
        if stage is _Stage.UNSCALED:
            raise ScalerStateError(
                "unscale_(optimizer) was already called for this optimizer since the last "
                "update(). Call it once per iteration, after the last backward of the iteration "
                "(after all micro-batches when accumulating gradients)."
            )
        if stage is _Stage.STEPPED:
            raise ScalerStateError(
                "unscale_(optimizer) was called after step(optimizer) in the same iteration: "
                "step() already unscaled and applied the gradients. Call unscale_ before step, "
                "or call update() to start the next iteration."
            )
        main = self._main_device()
        if id(optimizer) not in self._already_unscaled and self._num_losses > 1:
            raise ScalerStateError(
                f"this scaler has num_losses={self._num_losses}: each loss has its own scale, "
                f"so gradients must be unscaled per loss. Wrap each backward in "
                f"`with scaler.scaled(loss, optimizer, loss_id=i) as s: s.backward()`."
            )
        found = torch.zeros((), dtype=torch.float32, device=main)
        if id(optimizer) in self._already_unscaled:  # its scaled() blocks unscaled its grads
            own = self._block_found.get(id(optimizer))
            if own is not None:
                found = found + own
        else:
            loss = self._ensure(main)[0]
            try:
                groups = group_grads(p for g in optimizer.param_groups for p in g["params"])
            except Fp16GradientError as err:
                if not contract.consumes_scale_attributes(optimizer):
                    raise
                raise Fp16GradientError(
                    f"unscale_({type(optimizer).__name__}): its parameters hold fp16 gradients, "
                    f"which cannot be unscaled in place without losing their small values. "
                    f"{type(optimizer).__name__} takes the scale itself: call "
                    f"scaler.step(optimizer) without unscale_, and it divides the gradients by "
                    f"the scale in fp32 inside its update. Clipping needs unscaled gradients: "
                    f"clip with bf16 weights (dtype='bf16'), or keep fp32 masters (O2)."
                ) from err
            for device, per_dtype in groups.items():
                inv = self._inv_scale(loss, device)
                local = found if device == main else torch.zeros((), device=device)
                for grads in per_dtype.values():
                    unscale_and_check_(grads, inv, local, self._unscale_impl)
                if local is not found:
                    found = found + local.to(main, non_blocking=True)
        state = self._state(optimizer)
        state.found_inf = found
        state.pending = self._all_reduce(found, optimizer)
        state.stage = _Stage.UNSCALED

    def _check_only(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        # Fused optimizers unscale inside their kernel: only count non-finite scaled gradients,
        # per device (the keyword contract hands the per-device counts out).
        main = self._main_device()
        per_device: dict[torch.device, torch.Tensor] = {}
        groups = group_grads((p for g in optimizer.param_groups for p in g["params"]),
                             allow_fp16=True)  # fmt: skip
        for device, per_dtype in groups.items():
            local = per_device[device] = torch.zeros((), dtype=torch.float32, device=device)
            for grads in per_dtype.values():
                check_finite_(grads, local)
        if not per_device:
            per_device[main] = torch.zeros((), dtype=torch.float32, device=main)
        return per_device

    def _combine(self, per_device: dict[torch.device, torch.Tensor]) -> torch.Tensor:
        main = self._main_device()
        found = per_device.get(main)
        found = torch.zeros((), dtype=torch.float32, device=main) if found is None else found
        for device, local in per_device.items():
            if device != main:
                found = found + local.to(main, non_blocking=True)
        return found

    def _all_reduce(
        self, found: torch.Tensor, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if optimizer is not None and self._num_losses == 1:
            from mixprec.distributed.agreement import is_replicated

            if is_replicated(optimizer):
                # DDP all-reduced every gradient this optimizer steps: each rank counts the
                # same overflows from the same bits, so agreeing again would change nothing.
                return None
        # MAX, asynchronously: every rank then sees an overflow any rank saw, so all ranks skip
        # the same steps and keep the same scale. The handle is waited on before found is used;
        # for NCCL that makes the stream wait, not the host.
        return dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self._process_group,
                               async_op=True)  # fmt: skip

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done yet) and step, unless gradients overflowed. No sync.

        The skip happens on the device (see `mixprec.scaling.skip` for the modes and their
        costs); the return value is what ``optimizer.step`` returned (None when the step is
        skipped on the host). Optimizers that handle scaling themselves get torch's contracts
        (`mixprec.scaling.contract`): fused ones read ``grad_scale``/``found_inf`` (a preset
        ``optimizer.grad_scale`` is multiplied in, as torch does), older ones receive
        ``grad_scaler=self`` (with torch's FutureWarning).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        contract.check_optimizer(optimizer, "step")
        if "closure" in kwargs or (args and callable(args[0])):
            raise ScalerStateError(
                "GradScaler.step does not take a closure: a closure recomputes the loss inside "
                "optimizer.step(), where it can be neither scaled nor unscaled. Compute the loss, "
                "call scaler.scale(loss).backward() and then scaler.step(optimizer). Optimizers "
                "that require a closure (LBFGS) cannot be used with loss scaling; use bf16 "
                "without a scaler instead."
            )
        if self._peek(optimizer).stage is _Stage.STEPPED:
            raise ScalerStateError(
                "step(optimizer) was already called since the last update(). Call "
                "scaler.update() once per iteration, after stepping every optimizer."
            )
        guard = self._guard(optimizer)  # refuses LBFGS
        main = self._main_device()  # before any change: raises if nothing was scaled yet
        if not guard.keyword and id(optimizer) not in self._already_unscaled:
            _check_has_grads(optimizer)
        if guard.keyword:
            result = contract.keyword_step(self, optimizer, args, kwargs)
            self._state(optimizer).stage = _Stage.STEPPED
            return result
        # A grad_scale the user set on a fused optimizer: torch multiplies it with the scale
        # when the kernel unscales, and hands it on unchanged when the gradients are unscaled.
        preset = getattr(optimizer, "grad_scale", None) if guard.mode is SkipMode.FUSED else None
        grad_scale = preset
        if self._peek(optimizer).stage is _Stage.READY:
            if guard.mode is SkipMode.FUSED and id(optimizer) not in self._already_unscaled:
                state = self._state(optimizer)
                state.found_inf = self._combine(self._check_only(optimizer))
                state.pending = self._all_reduce(state.found_inf, optimizer)
                scale = self._ensure(main)[0].state.scale
                grad_scale = scale if preset is None else scale * preset
                state.stage = _Stage.UNSCALED
            else:
                self.unscale_(optimizer)
        deferred = self._deferred.get(id(optimizer))
        if deferred is not None:  # its scaled() blocks left the fp16 gradients scaled
            grad_scale = deferred if preset is None else deferred * preset
        state = self._state(optimizer)
        if state.pending is not None:
            state.pending.wait()
            state.pending = None
        assert state.found_inf is not None  # set by unscale_/_check_only above
        # The guards decide on the 0/1 flag: what fused kernels need, and what step_skipped reads.
        flag = self._flag(optimizer, state.found_inf)
        result = guard.step(optimizer, flag, grad_scale,
                            lambda: optimizer.step(*args, **kwargs))  # fmt: skip
        state.stage = _Stage.STEPPED
        return result

    def _guard(self, optimizer: torch.optim.Optimizer) -> StepGuard:
        """`optimizer`'s guard: its skip mode, snapshot and skip flag (created at first step)."""
        guard = self._known_guard(optimizer)
        if guard is not None:
            return guard
        guard = StepGuard(*choose_mode(optimizer, self._skip_mode))
        guard.owner = type(optimizer).__name__
        # Read once: inspecting a signature costs more than the rest of a step.
        guard.keyword = guard.mode is SkipMode.FUSED and contract.takes_scaler_keyword(optimizer)
        guard.ref = weakref.ref(optimizer)
        # Keyed by id; a dead optimizer's id can be reused, so drop the dead ones here.
        self._guards = {k: g for k, g in self._guards.items() if g.ref() is not None}
        self._guards[id(optimizer)] = guard
        return guard

    def _known_guard(self, optimizer: Any) -> StepGuard | None:
        guard = self._guards.get(id(optimizer))
        return guard if guard is not None and guard.ref() is optimizer else None

    def _flag(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> torch.Tensor:
        """Write `optimizer`'s persistent skip flag (0.0/1.0, fp32) from `found_inf`; return it."""
        guard = self._guard(optimizer)
        flag = guard.flag
        if flag is None or flag.device != found_inf.device:
            flag = guard.flag = torch.zeros_like(found_inf)
        flag.copy_(found_inf > 0)
        return flag

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale(s) for the next iteration: back off on overflow, grow when due. No sync.

        Args:
            new_scale: set the scale (of loss 0) to this value instead of the rule (the
                trackers stay as they are, as in torch; the counters and history still record
                the iteration).
        """
        if not self._enabled:
            return
        if new_scale is not None:
            new_scale = checked_new_scale(new_scale)
        if self._losses is None:
            raise ScalerStateError(
                "update() was called before the scaler scaled anything; the order per iteration "
                "is scale(loss).backward(), step(optimizer), update()."
            )
        steps = [s for s in self._per_optimizer.values() if s.found_inf is not None]
        if not steps and new_scale is None:
            raise ScalerStateError(
                "update() was called, but no optimizer was stepped or unscaled since the "
                "last update(). Call scaler.step(optimizer) for every optimizer first."
            )
        if steps:
            main = self._main_device()
            combined: torch.Tensor | None = None
            for s in steps:
                if s.pending is not None:
                    s.pending.wait()
                    s.pending = None
                found = s.found_inf.to(main, non_blocking=True)
                combined = found if combined is None else combined + found
            assert combined is not None  # `steps` is not empty
            # With several losses, a loss advances only in the iterations it ran in (a scaled()
            # block), as Apex's per-loss scalers did: on the host, or on the device where the
            # ranks must agree on it.
            ran: list[bool | torch.Tensor] = [True] * self._num_losses
            if self._num_losses > 1:
                ran = self._agree_per_loss(combined)
            # With a new scale, the counters and history still record the iteration; the
            # scale and trackers are set by hand (torch's update(new_scale) touches nothing
            # else either).
            config = self._config if new_scale is None else dataclasses.replace(
                self._config, dynamic=False
            )  # fmt: skip
            for loss, advance in zip(self._losses, ran, strict=True):
                # With one loss, every overflow is its own; with several, each loss answers
                # for the overflows of its own backward (its scaled() blocks).
                own = combined if self._num_losses == 1 else (
                    loss.found_inf if loss.found_inf is not None else torch.zeros_like(combined)
                )  # fmt: skip
                if advance is True and updates_in_place(config) and not dynamo_tracing():
                    update_scale_(loss.state, own, config)  # same bits, fewer kernels
                else:
                    self._replace(loss, update_scale(loss.state, own, config, advance))
                loss.found_inf = None
        if new_scale is not None:
            self._losses[0].state.scale.copy_(new_scale.reshape(()))
        for loss in self._losses:
            loss.replicas.clear()
        self._per_optimizer.clear()
        self._already_unscaled.clear()
        self._block_found.clear()
        self._deferred.clear()
        self.note_update()

    def note_update(self, count: int = 1) -> None:
        """Count `count` updates on the host; every `check_every`, report skips to ``on_skip``.

        ``update()`` calls it. A caller that replays a captured ``update()`` (``TrainStep``)
        calls it once per replay. Syncs only when a check is due.
        """
        self._unchecked += count
        self._host_updates += count
        if self._unchecked >= self._check_every:
            self.report_skips_now()

    def report_skips_now(self) -> None:
        """Report the skips of the updates not yet checked to ``on_skip`` and the listeners now,
        rather than at the next `check_every` boundary (one host sync; nothing while a CUDA
        graph records or nobody listens). `mixprec.watch_nonfinite` calls it on exit, so the
        skips of a watch's last updates reach it."""
        listening = self._on_skip is not None or self._listeners or self._report_listeners
        if not listening or not self._unchecked or capturing():
            return  # (a check reads the device: not while a CUDA graph records)
        report.report_skips(self)
        self._unchecked = 0
        for listener in list(self._report_listeners):
            listener(self._reported_steps)

    @property
    def host_updates(self) -> int:
        """Updates counted on the host so far (``update()`` calls and noted replays); no sync."""
        return self._host_updates

    def add_skip_listener(self, listener: Callable[[SkipEvent], None]) -> Callable[[], None]:
        """Also call `listener` for each overflowing update, like ``on_skip``; returns a remover.

        Listeners are called in the same batches as ``on_skip`` (every `check_every` updates,
        one host sync per batch); they are not pickled or saved in ``state_dict``.
        """
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    def add_report_listener(self, listener: Callable[[int], None]) -> Callable[[], None]:
        """Call ``listener(updates)`` after each skip report, once its skip events are out.

        A report runs every `check_every` updates while anyone listens (one host sync, which
        this adds to nothing); `updates` is the number of updates the report covered. For
        listeners that decide per batch of skips (``initialize(..., heal=True)``); not pickled
        or saved in ``state_dict``. Returns a remover.
        """
        self._report_listeners.append(listener)

        def remove() -> None:
            if listener in self._report_listeners:
                self._report_listeners.remove(listener)

        return remove

    @property
    def check_every(self) -> int:
        """Updates between skip reports (``on_skip``, listeners); each report is one sync."""
        return self._check_every

    @check_every.setter
    def check_every(self, value: int) -> None:
        if not (is_int(value) and value >= 1):
            raise ScalerConfigError(f"GradScaler check_every={value!r} must be an int >= 1.")
        self._check_every = value

    def _agree_per_loss(self, like: torch.Tensor) -> list[bool | torch.Tensor]:
        """Which losses ran this iteration (host bools; device flags agreed across ranks)."""
        # Each loss's overflows, and whether it ran, must be the same on every rank, or
        # per-loss scales drift apart: one MAX all-reduce of both, when distributed.
        assert self._losses is not None
        ran = [loss.found_inf is not None for loss in self._losses]
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return list(ran)
        found = torch.stack([
            loss.found_inf if loss.found_inf is not None else torch.zeros_like(like)
            for loss in self._losses
        ])  # fmt: skip
        flags = torch.tensor(ran, dtype=found.dtype).to(found.device, non_blocking=True)
        both = torch.stack([found, flags])
        work = self._all_reduce(both)
        if work is not None:
            work.wait()
        for i, loss in enumerate(self._losses):
            loss.found_inf = both[0, i]
        return [both[1, i] > 0 for i in range(len(self._losses))]

    @staticmethod
    def _replace(loss: _Loss, new: ScaleState) -> None:
        # Copy into the existing tensors: a captured graph holds their addresses.
        for cur, nxt in zip(loss.state, new, strict=True):
            cur.copy_(nxt)

    # ----------------------------------------------------------------- reading (syncs)

    def get_scale(self) -> float:
        """The current scale (of loss 0) as a Python float; 1.0 when disabled.

        Warning: reads a device tensor, i.e. synchronises with the device.
        """
        if not self._enabled:
            return 1.0
        if self._losses is None:
            return float(checkpoint.pending_scale(self._pending_load, self._init_scale))
        return float(self._losses[0].state.scale.item())

    @property
    def scale_tensor(self) -> torch.Tensor | None:
        """The scale (of loss 0) as a device tensor, without a sync; None before first use."""
        return None if self._losses is None else self._losses[0].state.scale

    def stats(self) -> dict[str, Any]:
        """Counters and trackers of every loss scale, as Python values. Synchronises."""
        return checkpoint.describe(self)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last ``update()`` saw an overflow, i.e. that iteration's steps were skipped.

        For code that needs a Python bool, such as Accelerate's ``step_was_skipped`` or the
        Transformers Trainer deciding whether to step its LR scheduler. With several optimizers,
        True when any of them overflowed (the others stepped: see `step_skipped`). False before
        the first update and when disabled. Survives ``state_dict`` and pickling.

        Warning: reads the device, i.e. synchronises (once per read). To keep an LR schedule in
        step without a sync, use `mixprec.SkipAwareLR`.
        """
        return report.last_step_skipped(self)

    def explain(self) -> str:
        """The settings, how each optimizer stepped so far is skipped and why, and every
        automatic decision with its reason. Reads the scale (a sync)."""
        return report.explain(self)

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """A 0-dim device tensor: 1.0 where `optimizer`'s last ``scaler.step`` was skipped. No sync.

        The same tensor after every step (it is written in place), so device-side code and
        captured graphs can read it; None before the optimizer's first step through this
        scaler. Wrapped optimizers (``mixprec.initialize``'s, Accelerate's) are looked up by
        the optimizer they wrap.
        """
        seen: set[int] = set()
        while optimizer is not None and id(optimizer) not in seen:
            guard = self._known_guard(optimizer)
            if guard is not None and guard.flag is not None:
                return guard.flag
            seen.add(id(optimizer))
            optimizer = getattr(optimizer, "optimizer", None)
        return None

    # ------------------------------------------- torch.amp.GradScaler's methods for optimizers
    # Optimizers of torch's keyword contract call these private methods of torch's scaler
    # (`mixprec.scaling.contract`); they keep torch's meaning here.

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """torch's: flag non-finite (still scaled) gradients per device, without unscaling."""
        return contract.check_inf_per_device(self, optimizer)

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """torch's: the flags recorded for `optimizer` this iteration (by unscale_ or a check)."""
        found = self._peek(optimizer).found_inf
        return {} if found is None else {found.device: (found > 0).float()}

    def _get_scale_async(self) -> torch.Tensor | None:
        """torch's: the scale (of loss 0) as a device tensor, no sync; None before first use."""
        return self.scale_tensor

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """torch's: create the scale state on `dev` now rather than at the first ``scale()``
        (Accelerate calls it after loading a checkpoint under FSDP2). A loaded state dict is
        applied; a scaler already in use is left as it is (torch's raises there)."""
        if self._enabled:
            self._ensure(torch.device(dev))

    def _get_growth_tracker(self) -> int:
        """torch's: clean steps since the last growth or overflow (loss 0); 0 when disabled.
        One host sync once the state exists."""
        if not self._enabled:
            return 0
        if self._losses is None:
            pending = (self._pending_load or [{}])[0]
            return int(pending.get("growth_tracker", 0))
        return int(self._losses[0].state.growth_tracker.item())

    # ----------------------------------------------------------------- config accessors

    def get_growth_factor(self) -> float:
        """The growth factor."""
        return self._config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (validated)."""
        self._config = dataclasses.replace(self._config, growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor."""
        return self._config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (validated)."""
        self._config = dataclasses.replace(self._config, backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval."""
        return self._config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (validated)."""
        self._config = dataclasses.replace(self._config, growth_interval=new_interval)

    @property
    def config(self) -> ScaleConfig:
        """The frozen growth/backoff rule in force."""
        return self._config

    def is_enabled(self) -> bool:
        """Whether this scaler scales at all."""
        return self._enabled

    def skip_mode(self, optimizer: torch.optim.Optimizer) -> tuple[str, str]:
        """How this scaler skips `optimizer`'s overflowing steps, and why.

        After the optimizer's first step the answer includes what that step revealed (state
        that snapshot-and-restore cannot hold back makes every step a host decision).

        Raises:
            ScalerConfigError: the optimizer cannot be used with loss scaling (LBFGS).
        """
        contract.check_optimizer(optimizer, "skip_mode")
        guard = self._known_guard(optimizer)
        if guard is not None:
            return guard.mode.value, guard.reason
        mode, reason = choose_mode(optimizer, self._skip_mode)
        return mode.value, reason

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Every field of the scaler (torch.amp's five keys included). Synchronises.

        Call it between iterations (after ``update()``); empty when disabled.
        """
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from ``state_dict()`` or from ``torch.amp.GradScaler``.

        The whole dict is validated first; on any error nothing changes.
        """
        checkpoint.load_state_dict(self, state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle and ``copy.deepcopy`` support, between iterations only (as torch).

        The device state travels as Python values (a sync) and is recreated on first use, on
        the device of the first scaled tensor; the per-optimizer guards (snapshots, skip flags)
        and skip listeners are not carried.
        """
        if self._per_optimizer:
            raise ScalerStateError(
                "a GradScaler can only be pickled or copied between iterations (before the "
                "first unscale_/step of an iteration, or after update()); this one is in the "
                "middle of an iteration: call scaler.update() first."
            )
        state = self.__dict__.copy()
        state["_pending_load"] = checkpoint.pending_entries(self)
        state["_losses"] = None
        state["_guards"] = {}
        state["_listeners"] = []
        state["_report_listeners"] = []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_block_found", {})  # pickled by an earlier mixprec
        self.__dict__.setdefault("_deferred", {})
        self.__dict__.setdefault("_report_listeners", [])
