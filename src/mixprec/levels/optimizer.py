"""`AmpOptimizer`: the optimizer ``initialize`` returns, carrying master weights and the scaler.

Composition, not patching: the wrapper holds an inner torch optimizer and forwards to it. For O2
the inner optimizer is a new instance of the user's optimizer class, built with the same param
groups and hyperparameters over fp32 *master* copies of the model's low-precision weights (fp32
parameters, such as normalization layers kept in fp32, are their own masters). The user's
optimizer object is left alone.

The O2 step, and what it costs:

1. after each backward (``scale_loss`` exit), the low-precision gradients are added into the
   masters' fp32 gradients and dropped, so accumulation over micro-batches happens in fp32.
   Without loss scaling (bf16) the first backward's gradients wait on the model in bf16 until
   the step, ``master_params`` or the next backward moves them: 2 bytes per parameter between
   backward and step instead of 4, so O2 holds fp32 training's 16 bytes per parameter there
   (AdamW), not 18; the fp32 gradients exist only from the move to the next iteration;
2. the scaler unscales and checks the master gradients (fp16) and ``step`` runs the inner
   optimizer on the masters, skipped on the device on overflow;
3. the masters are copied back into the model's weights (one multi-tensor cast-copy), which is
   harmless after a skipped step: the masters did not change.

The wrapper subclasses ``torch.optim.Optimizer`` so that LR schedulers accept it; its
``param_groups`` and ``state`` *are* the inner optimizer's, so schedulers and
``clip_grad_norm_`` act on what is stepped (the masters, in O2).

Apex compatibility (its semantics, kept where Apex users relied on them):

- an object that wraps an optimizer and exposes ``param_groups``, ``state``, ``step`` and
  ``zero_grad`` (Apex's LARC) is accepted as the inner optimizer; for O2 it is copied around an
  inner optimizer rebuilt over the masters (`rebuild_wrapper`);
- ``add_param_group`` gives new low-precision parameters fp32 masters, as Apex's patched
  ``add_param_group`` did;
- the masters' gradients belong to one step: the first ``scale_loss`` after a step drops them
  (Apex dropped them in ``step``), so zeroing the *model's* gradients (``model.zero_grad()``,
  ``p.grad = None``) is enough between iterations, as under Apex;
- ``state_dict()`` is a plain optimizer state dict (``state``, ``param_groups``) with mixprec's
  entries beside it, so a plain optimizer built over the model's parameters loads it before
  ``initialize`` (Apex's checkpoints allowed either order); ``load_state_dict`` also takes a
  plain optimizer's state dict (an Apex checkpoint's), leaving masters and scaler as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.errors import ArgumentTypeError, MixprecError, UsageError
from mixprec.fp8.convert import fp8_update
from mixprec.levels.model_state import MasterMap
from mixprec.levels.presets import AmpOptions
from mixprec.scaling import checkpoint
from mixprec.scaling.scaler import GradScaler, ScalerStateError

__all__ = [
    "LOW_PRECISION",
    "AmpOptimizer",
    "LossScaling",
    "build_inner",
    "constructor_defaults",
    "optimizer_like",
    "rebuild_wrapper",
    "wrapped_optimizer",
]

FORMAT = "mixprec.AmpOptimizer/2"
#: The format before the optimizer's own entries moved to the top level (still loaded).
FORMAT_V1 = "mixprec.AmpOptimizer/1"
#: mixprec's entries beside the inner optimizer's in a state dict.
_OURS = ("format", "opt_level", "masters", "scaler", "heal")
#: Parameter dtypes that get fp32 masters.
LOW_PRECISION = (torch.float16, torch.bfloat16)


class AmpCheckpointError(MixprecError, ValueError):
    """An AmpOptimizer state dict that does not fit this optimizer (nothing was changed)."""


def _not_ours(state_dict: Any) -> str:
    """Why `state_dict` is not an AmpOptimizer's, and where it belongs."""
    if not isinstance(state_dict, dict):
        return f"AmpOptimizer.load_state_dict expects a dict, got {type(state_dict).__name__}."
    fmt = state_dict.get("format")
    head = f"not an AmpOptimizer state dict (format {fmt!r}, expected {FORMAT!r})"
    if fmt == checkpoint.FORMAT or (fmt is None and "_growth_tracker" in state_dict):
        return f"{head}: it is a GradScaler's; load it with optimizer.scaler.load_state_dict(...)."
    if fmt == "mixprec.TrainStep/1":
        return f"{head}: it is a TrainStep's; load it with step.load_state_dict(...)."
    return f"{head}; save it with AmpOptimizer.state_dict()."


class LossScaling:
    """The loss scaler shared by the optimizers of one ``initialize`` call.

    ``update()`` must run once per iteration after every optimizer stepped; with several
    optimizers nobody knows which steps last, so the update is deferred to the start of the
    next ``scale_loss`` (or to ``state_dict``/``loss_scale``), and run if any step happened.

    With ``eager_update=True`` the update runs right after each optimizer's step instead: what a
    framework that steps one optimizer per iteration expects (Lightning, Accelerate, the
    Transformers Trainer: `mixprec.integrations`), so the scale, the skip flag and the counters
    describe the step that just ran.
    """

    def __init__(self, scaler: GradScaler | None, *, eager_update: bool = False) -> None:
        self.scaler = scaler
        self.eager_update = eager_update
        self.pending = False  # an optimizer stepped since the last update
        self.scaled = False  # scale_loss ran in this iteration
        self.stepped: set[int] = set()  # optimizers stepped in this iteration
        self.healer: Any = None  # initialize(..., heal=...): `mixprec.heal.online.Healer`

    def flush(self) -> None:
        """Run the deferred ``update()``, if a step is waiting for it; start a new iteration."""
        if self.pending and self.scaler is not None:
            self.scaler.update()
        self.pending = False
        self.scaled = False
        self.stepped.clear()


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer`'s defaults that its class's constructor takes: some are derived (torch 2.11's
    AdamW records decoupled_weight_decay, which its __init__ rejects), so a rebuild from
    ``defaults`` must leave them out."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}


def optimizer_like(obj: Any) -> bool:
    """A torch optimizer, or an object used as one: it exposes ``param_groups``, ``state``,
    ``step`` and ``zero_grad`` (Apex's LARC, which wraps an optimizer, does)."""
    if isinstance(obj, torch.optim.Optimizer):
        return True
    if isinstance(obj, (torch.nn.Module, torch.Tensor)) or not hasattr(obj, "param_groups"):
        return False
    return hasattr(obj, "state") and all(
        callable(getattr(obj, name, None)) for name in ("step", "zero_grad")
    )


def wrapped_optimizer(wrapper: Any) -> str:
    """The attribute of an optimizer wrapper (LARC) that holds the torch optimizer it wraps.

    Raises:
        MixprecError: the wrapper does not hold exactly one torch optimizer among its
            attributes, so it cannot be rebuilt over master weights: pass a factory instead.
    """
    fields = getattr(wrapper, "__dict__", None) or {}
    inner = [k for k, v in fields.items() if isinstance(v, torch.optim.Optimizer)]
    if len(inner) != 1:
        name = type(wrapper).__name__
        raise ArgumentTypeError(
            f"cannot rebuild {name} over fp32 master weights: it does not hold exactly one "
            f"torch optimizer in its attributes (found {len(inner)}). Pass a factory instead: "
            f"mixprec.initialize(model, lambda params: {name}(torch.optim.SGD(params, ...)), "
            f"opt_level='O2')."
        )
    return inner[0]


def rebuild_wrapper(wrapper: Any, masters: dict[int, torch.Tensor]) -> Any:
    """A copy of an optimizer wrapper (LARC) around its inner optimizer rebuilt over `masters`.

    The wrapper must hold exactly one torch optimizer among its attributes (`wrapped_optimizer`);
    the copy shares its other attributes and is made without calling its constructor. The
    wrapper passed in is left alone (as `build_inner` leaves an optimizer alone).
    """
    name = wrapped_optimizer(wrapper)
    copy = object.__new__(type(wrapper))
    copy.__dict__.update(wrapper.__dict__)
    copy.__dict__[name] = build_inner(wrapper.__dict__[name], masters)
    return copy


def _cannot_rebuild(cls: type, err: Exception) -> MixprecError:
    return ArgumentTypeError(
        f"cannot rebuild {cls.__name__} over fp32 master weights from its defaults ({err}). "
        f"Pass a factory instead of an instance: mixprec.initialize(model, lambda params: "
        f"{cls.__name__}(params, ...), opt_level='O2')."
    )


def check_rebuildable(optimizer: torch.optim.Optimizer) -> None:
    """Raise `build_inner`'s error now if `optimizer`'s class cannot be called with its groups
    and defaults (a required constructor argument it does not record): ``initialize`` checks
    before it changes any model.

    Raises:
        MixprecError: as `build_inner`.
    """
    cls = type(optimizer)
    try:
        inspect.signature(cls).bind(optimizer.param_groups, **constructor_defaults(optimizer))
    except TypeError as err:
        raise _cannot_rebuild(cls, err) from err
    except ValueError:  # no signature to read (a C-level class): build_inner will tell
        pass


def build_inner(
    optimizer: torch.optim.Optimizer, masters: dict[int, torch.Tensor]
) -> torch.optim.Optimizer:
    """A new optimizer of `optimizer`'s class over the master tensors, with its groups and state.

    Raises:
        MixprecError: the class cannot be rebuilt from its ``defaults`` (a custom optimizer
            with extra constructor arguments): pass a factory instead.
    """
    groups = []
    for group in optimizer.param_groups:
        new = {k: v for k, v in group.items() if k != "params"}
        new["params"] = [masters.get(id(p), p) for p in group["params"]]
        groups.append(new)
    cls = type(optimizer)
    defaults = constructor_defaults(optimizer)
    try:
        inner = cls(groups, **defaults)
    except TypeError as err:
        raise _cannot_rebuild(cls, err) from err
    if optimizer.state:
        inner.load_state_dict(optimizer.state_dict())
    return inner


class AmpOptimizer(torch.optim.Optimizer):
    """An optimizer with its opt level's master weights and loss scaler attached.

    Use it like the optimizer it wraps: ``zero_grad()``, backward inside
    ``mixprec.scale_loss(loss, optimizer)``, ``step()``. `optimizer` is the inner torch
    optimizer; `scaler` the `mixprec.GradScaler` (None without loss scaling).
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        options: AmpOptions,
        scaling: LossScaling,
        low_params: list[torch.Tensor],
        masters: list[torch.Tensor],
        fp8_layers: list[Any] | None = None,
        master_map: MasterMap | None = None,
    ) -> None:
        # Initialize Optimizer's bookkeeping (hooks, profiling names) on a placeholder, then
        # share the inner optimizer's groups, state and defaults (properties below: the inner
        # optimizer's load_state_dict replaces its group list, and schedulers must follow).
        super().__init__([torch.zeros(0, requires_grad=True)], {})
        self.optimizer = inner
        self.options = options
        self._scaling = scaling
        self._low = low_params  # model weights in the low dtype ...
        self._masters = masters  # ... and their fp32 masters, index for index
        self._fp8 = list(fp8_layers or ())  # FP8 layers whose scales advance with this step
        self._master_map = master_map if master_map is not None else MasterMap()
        self._stepped = False  # a step consumed the masters' gradients; zero_grad resets it
        self._deferred = False  # a bf16 backward left gradients on the model (_after_backward)
        # The models' hooks (their `unsynced`: the last forward ran in DDP's no_sync()), and
        # whether gradients of such backwards wait on the weights for DDP's reduction.
        self._hooks: list[Any] = []
        self._held = False
        # Wrappers such as Apex's LARC define zero_grad() without torch's set_to_none.
        params = inspect.signature(inner.zero_grad).parameters
        self._zero_grad_flag = "set_to_none" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )

    # The inner optimizer's, always (torch's Optimizer.__init__ assigns placeholders first).
    def _shared(name: str) -> property:
        def get(self: AmpOptimizer) -> Any:
            own = self.__dict__
            if "optimizer" in own:
                if name == "param_groups" and own.get("_deferred"):
                    # Code that reads the stepped tensors' gradients from the groups (clipping
                    # them, as with a plain optimizer) finds them in the masters, in fp32.
                    self._after_backward()
                return getattr(own["optimizer"], name)
            if "_pre_" + name in own:  # inside torch's Optimizer.__init__
                return own["_pre_" + name]
            return getattr(self.optimizer, name)  # a wrapper's view (LightningOptimizer)

        def set_(self: AmpOptimizer, value: Any) -> None:
            own = self.__dict__
            if "optimizer" in own:
                setattr(own["optimizer"], name, value)
            elif hasattr(type(self), "_optimizer") or "_optimizer" in own:
                setattr(self.optimizer, name, value)
            else:
                own["_pre_" + name] = value

        return property(get, set_, doc=f"The inner optimizer's ``{name}``.")

    param_groups = _shared("param_groups")  # type: ignore[assignment]
    state = _shared("state")  # type: ignore[assignment]
    defaults = _shared("defaults")  # type: ignore[assignment]
    del _shared

    def __repr__(self) -> str:
        return (f"AmpOptimizer({self.options.level.value}, {type(self.optimizer).__name__}, "
                f"masters={len(self._masters)}, scaler={self.scaler is not None})")  # fmt: skip

    @property
    def scaler(self) -> GradScaler | None:
        """The loss scaler (shared by the optimizers of one ``initialize`` call)."""
        return self._scaling.scaler

    @property
    def healer(self) -> Any:
        """The `mixprec.Healer` moving overflowing modules to fp32 (``initialize(...,
        heal=True)``), shared by the optimizers of one call; None without healing."""
        return self._scaling.healer

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without scaling). Synchronises with the device."""
        self._scaling.flush()
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def master_params(self) -> Iterable[torch.Tensor]:
        """The tensors the inner optimizer steps (fp32 masters in O2; the model's otherwise),
        with this iteration's gradients on them (moved from the model's weights if a backward
        left them there: reading ``param_groups`` moves them)."""
        for group in self.param_groups:
            yield from group["params"]

    # ----------------------------------------------------------------- the step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the inner optimizer; in O2 its low-precision parameters get fp32
        masters (as Apex's patched ``add_param_group`` did), fp32 ones are their own."""
        if "optimizer" not in self.__dict__:  # torch's Optimizer.__init__: the placeholder
            super().add_param_group(param_group)
            return
        if not isinstance(param_group, dict):
            raise ArgumentTypeError(
                f"param_group must be a dict, got {type(param_group).__name__}."
            )
        group = dict(param_group)
        params = group.get("params")
        if isinstance(params, set):
            raise ArgumentTypeError(
                "a param group's params must be an ordered collection (a list), not a set: a "
                "set's order changes between runs, and the optimizer state is saved by order."
            )
        params = [params] if isinstance(params, torch.Tensor) else list(params or ())
        # torch's own check cannot see a weight whose master is already stepped here.
        present = {id(t) for g in self.param_groups for t in g["params"]}
        present |= {id(t) for t in self._low}
        if any(id(p) in present for p in params):
            raise UsageError(
                "some parameters appear in more than one parameter group (or are already "
                "stepped by this optimizer through their fp32 master); add each parameter once."
            )
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.options.master_weights:
            stepped = []
            for p in params:
                if isinstance(p, torch.Tensor) and p.dtype in LOW_PRECISION:
                    master = p.detach().clone().float().requires_grad_(p.requires_grad)
                    pairs.append((p, master))
                    stepped.append(master)
                else:
                    stepped.append(p)
            params = stepped
        group["params"] = params
        self.optimizer.add_param_group(group)  # validates (duplicates, types) before we commit
        for low, master in pairs:
            self._low.append(low)
            self._masters.append(master)
            self._master_map.add(low, master)

    def _start_backward(self) -> None:
        """``scale_loss`` entry: the first after a step drops the masters' stale gradients; a
        later one (accumulation) first moves the gradients an earlier backward left on the
        model into the masters, so micro-batches add up in fp32, not in the low dtype."""
        if self._stepped:
            self._stepped = False
            for master in self._masters:
                master.grad = None
        if not self._held:  # (held: they stay for DDP to reduce with this backward's)
            self._after_backward()

    def _unsynced(self) -> bool:
        return bool(self._low) and any(h.unsynced for h in self._hooks)

    def _after_backward(self, defer: bool = False, force: bool = False) -> None:
        """Move the model's low-precision gradients into the fp32 masters (O2).

        With `defer` (a backward without loss scaling), a gradient whose master has none yet
        stays on the model's weight in the low dtype until something needs it in fp32: the
        step, `master_params`, reading ``param_groups``, or the next backward (accumulation).
        Between backward and step O2 then holds 2 bytes of gradient per parameter, not 4: as
        much training state as fp32 training (16 bytes per parameter with AdamW), where the
        fp32 copy made here held 18. The values are the same either way: the fp32 gradient is
        the exact upcast of the low one. Scaled gradients (fp16) move at once: they are
        unscaled in fp32.

        Under DDP's ``no_sync()`` (the model's last forward ran inside it) nothing moves unless
        `force`: DDP's next synchronised backward all-reduces what the weights' ``.grad`` hold,
        so the micro-batches accumulate there, in the low dtype, and move after that backward
        (moved earlier, each rank kept its own and the replicas drifted apart).
        """
        if not force and self._unsynced():
            self._held = self._deferred = True
            return
        self._held = False
        left = False
        with torch.no_grad():
            for low, master in zip(self._low, self._masters, strict=True):
                if low.grad is None:
                    continue
                if master.grad is None:
                    if defer:
                        left = True
                        continue
                    master.grad = low.grad.to(master.dtype)
                else:
                    master.grad.add_(low.grad)
                low.grad = None
        self._deferred = left

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the masters and of the model's weights."""
        if self._zero_grad_flag:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self.optimizer.zero_grad()
        for low in self._low:
            low.grad = None
        self._stepped = self._held = False

    def step(self, closure: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Step the inner optimizer (on the masters in O2); skipped on the device on overflow.

        Keyword arguments go to the inner optimizer's ``step``. A closure (LBFGS) is passed on
        only without loss scaling and fp32 masters (bf16 at O1 or O3): a loss the closure
        recomputes inside the step could be neither scaled nor moved into the masters.
        """
        if closure is not None and (self.scaler is not None or self._low):
            why = "scales the loss" if self.scaler is not None else "steps fp32 master weights"
            raise ScalerStateError(
                f"AmpOptimizer.step got a closure, but {self.options.level.value} {why}: a loss "
                f"recomputed inside step() can be neither scaled nor moved into the masters. "
                f"Compute the loss and call backward inside mixprec.scale_loss(loss, optimizer), "
                f"then optimizer.step(); an optimizer that needs a closure (LBFGS) runs with "
                f"bf16 at O1 or O3 (no loss scaling, no masters)."
            )
        if self._held and self.scaler is not None:
            raise ScalerStateError(
                "optimizer.step() after a backward under DDP's no_sync(): those gradients are "
                "this rank's alone (DDP reduces them with the next backward outside no_sync) and "
                "still scaled. Run the last micro-batch of the step outside no_sync()."
            )
        if self._stepped:
            # A plain backward since the last step (bf16, no scale_loss block): the masters
            # still hold the gradients that step used; drop them, as `_start_backward` does,
            # or every step would add all earlier gradients again.
            self._stepped = False
            for master in self._masters:
                master.grad = None
        self._after_backward(force=True)
        scaler = self.scaler
        if scaler is None:
            args = () if closure is None else (closure,)
            result = self.optimizer.step(*args, **kwargs)
        else:
            if not self._scaling.scaled or id(self) in self._scaling.stepped:
                raise ScalerStateError(
                    f"{self.options.level.value} scales the loss "
                    f"(loss_scale={self.options.loss_scale!r}): call backward inside "
                    f"`with mixprec.scale_loss(loss, optimizer) as scaled: scaled.backward()` "
                    f"before optimizer.step(); a plain loss.backward() leaves gradients the "
                    f"scaler cannot interpret."
                )
            result = scaler.step(self.optimizer, **kwargs)
            self._scaling.pending = True
            self._scaling.stepped.add(id(self))
        if self._fp8:
            # Histories and scales advance with the step, and stay as they were when the
            # scaler skipped it (on the device: no sync).
            skipped = scaler.step_skipped(self.optimizer) if scaler is not None else None
            fp8_update(self._fp8, skipped)
        if self._low:
            with torch.no_grad():
                torch._foreach_copy_(self._low, self._masters)
        if self._scaling.eager_update:
            self._scaling.flush()
        self._stepped = True
        return result

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer, fp32 masters and scaler, in one dict. Synchronises (reads the scale).

        The inner optimizer's entries (``state``, ``param_groups``) are at the top level, as in
        any optimizer's state dict, so a plain optimizer over the model's parameters loads this
        dict too (before ``initialize``, which then carries its state over); mixprec's entries
        (``format``, ``opt_level``, ``masters``, ``scaler``) sit beside them.
        """
        self._scaling.flush()
        out = dict(self.optimizer.state_dict())
        out.update({
            "format": FORMAT,
            "opt_level": self.options.level.value,
            "masters": [m.detach().clone() for m in self._masters],
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        })  # fmt: skip
        if self.healer is not None:  # the modules healing moved to fp32 (a resumed run keeps them)
            out["heal"] = self.healer.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict`` wrote; everything is checked before anything changes.

        Also takes a plain optimizer's state dict (one without mixprec's entries, such as an
        Apex checkpoint's ``'optimizer'``): it goes to the inner optimizer, and the masters and
        the scaler stay as they are (the masters follow ``model.load_state_dict``; load an
        Apex ``'amp'`` entry with ``optimizer.scaler.load_state_dict``).
        """
        if _plain(state_dict):
            self._scaling.flush()
            self._load_inner(state_dict)
            self._scaling.pending = False
            return
        fmt = state_dict.get("format") if isinstance(state_dict, dict) else None
        if fmt not in (FORMAT, FORMAT_V1):
            raise AmpCheckpointError(_not_ours(state_dict))
        if fmt == FORMAT_V1:
            inner_sd = state_dict.get("optimizer")
        else:
            inner_sd = {k: v for k, v in state_dict.items() if k not in _OURS}
        if state_dict.get("opt_level") != self.options.level.value:
            raise AmpCheckpointError(
                f"the state dict was saved at opt level {state_dict.get('opt_level')!r}, this "
                f"optimizer runs {self.options.level.value!r}: initialize with the same level."
            )
        masters = state_dict.get("masters")
        if (
            not isinstance(masters, list)
            or len(masters) != len(self._masters)
            or any(
                not isinstance(a, torch.Tensor) or a.shape != b.shape
                for a, b in zip(masters, self._masters, strict=False)
            )
        ):
            raise AmpCheckpointError(
                f"the state dict's master weights do not match this model: expected "
                f"{len(self._masters)} tensors of shapes {[tuple(m.shape) for m in self._masters]}."
            )
        scaler_sd = state_dict.get("scaler")
        if (scaler_sd is None) != (self.scaler is None):
            raise AmpCheckpointError(
                "the state dict's loss-scaling setting differs from this optimizer's; "
                "initialize with the same loss_scale."
            )
        if self.scaler is not None and self.scaler.is_enabled():
            try:  # against this scaler (its num_losses), without loading yet
                checkpoint.validate(self.scaler, scaler_sd, in_iteration_ok=True)
            except checkpoint.ScalerCheckpointError as err:
                raise AmpCheckpointError(f"state_dict['scaler'] is refused: {err}") from err
        heal = state_dict.get("heal")
        if self.healer is None and isinstance(heal, dict) and heal.get("moves"):
            raise AmpCheckpointError(
                f"the checkpoint was trained with healing, which moved "
                f"{[m.get('module') for m in heal['moves']]} to fp32; initialize with heal=True "
                f"to resume with them (or policy=mixprec.Policy().keep_fp32(...) to keep them "
                f"fixed)."
            )
        if self.healer is not None:
            from mixprec.heal.online import FORMAT as HEAL_FORMAT

            heal = heal if heal is not None else {"format": HEAL_FORMAT, "moves": []}
            try:
                self.healer.check_state(heal)
            except MixprecError as err:
                raise AmpCheckpointError(f"state_dict['heal'] is refused: {err}") from err
        # Everything checked. A step whose scale update is still deferred belongs to the old
        # run: finish it, so the scaler is between iterations when its state is replaced.
        self._scaling.flush()
        self._load_inner(inner_sd)
        with torch.no_grad():
            for dst, src in zip(self._masters, masters, strict=True):
                dst.copy_(src)
            if self._low:
                torch._foreach_copy_(self._low, self._masters)
        if self.scaler is not None:
            self.scaler.load_state_dict(scaler_sd)
        if self.healer is not None:
            self.healer.load_state_dict(heal)
        self._scaling.pending = False

    def _load_inner(self, state_dict: Any) -> None:
        """Load the inner optimizer's state; on refusal put the old state back and raise."""
        snapshot = self.optimizer.state_dict()
        try:
            self.optimizer.load_state_dict(state_dict)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            self.optimizer.load_state_dict(snapshot)
            raise AmpCheckpointError(f"the inner optimizer refused its state: {err}") from err


def _plain(state_dict: Any) -> bool:
    """A plain optimizer's state dict: torch's two entries and no ``format`` of ours."""
    return (
        isinstance(state_dict, dict)
        and "format" not in state_dict
        and "state" in state_dict
        and "param_groups" in state_dict
    )
