"""The precision half of a training step, for frameworks that own the loop.

Lightning, Accelerate and the Transformers Trainer each run forward, backward, clipping and the
optimizer step themselves and offer hooks around them. `AmpEngine` is what those hooks call, the
same for all three, so that an opt level means the same thing in each and in a hand-written
``mixprec.initialize`` loop:

- forward: O1 runs under a ``mixprec.autocast`` region (the policy); O2 and O3 cast the model
  to the low dtype (O2 keeps norm layers in fp32, casts inputs at the model's entry and returns
  fp32 outputs);
- backward: the loss times the scale when the level scales (fp16); in O2 the low-precision
  gradients are added into the fp32 masters after each backward, so accumulation is in fp32,
  except under DDP's ``no_sync()`` (the framework's accumulation: Accelerate's ``accumulate``,
  Lightning's ``accumulate_grad_batches``, Fabric's ``no_backward_sync``), where they wait on
  the weights, in the low dtype DDP reduces in, for DDP's synchronised backward (moved
  earlier, each rank kept its own and the replicas drifted apart);
- before clipping: unscale once per step (the masters in O2); clipping acts on what is stepped;
- step: ``scaler.step`` and ``update`` (an overflowing step is skipped on the device), then in
  O2 the masters are copied into the model; O3 and bf16 steps are plain.

The optimizers become `AmpOptimizer`s (``wrap_optimizer``), each with its own eager scale update,
so that ``optimizer.step()`` is the whole scaled step wherever a framework calls it and the
scaler's state describes the step that just ran. bf16 uses no scaler (nothing to skip).

A model sharded with FSDP2 before ``convert_module`` (Lightning's ``configure_model``) keeps its
own mixed precision: `mixprec.fully_shard` applied the level while sharding (FSDP's fp32 shards
are the masters), so the engine casts nothing, keeps no masters, and wraps the user's optimizer
itself (``sharded``: no rebuilt optimizer), adding only the scaler, as ``mixprec.initialize``
does for such a model.

Costs: those of the opt level (`docs/migration.md`); no host-device sync in any hook. Reading
whether the last step was skipped as a Python bool (what Accelerate and the Transformers
Trainer ask before stepping the LR schedule) is one sync: ``last_step_skipped``.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from mixprec.distributed.topology import fsdp_modules
from mixprec.eager.autocast import autocast
from mixprec.errors import MixprecError, format_options
from mixprec.heal.online import make_healer
from mixprec.integrations.errors import IntegrationError
from mixprec.integrations.sharded import check_sharded
from mixprec.levels import keep_fp32
from mixprec.levels.initialize import _prepare_model
from mixprec.levels.model import amp_hooks
from mixprec.levels.optimizer import AmpOptimizer, LossScaling, build_inner
from mixprec.levels.presets import OVERRIDES, AmpOptions, OptLevel, resolve
from mixprec.policy.policy import Policy
from mixprec.scaling.scaler import GradScaler

__all__ = ["FORMAT", "AmpConfig", "AmpEngine", "IntegrationError", "unwrap_optimizer"]

FORMAT = "mixprec.AmpEngine/1"

# Models converted by an engine: (what the conversion did, the engine's masters). A later engine
# (a new Trainer's plugin for trainer.test after fit, a second fit) finds the model cast, with
# its hooks on: it takes the same masters over instead of refusing the model.
_CONVERTED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], dict[int, torch.Tensor]]]
_CONVERTED = weakref.WeakKeyDictionary()


def _scaler_args() -> list[str]:
    params = inspect.signature(GradScaler.__init__).parameters
    return [n for n in params if n not in ("self", "device", "enabled")]


def _freeze(value: Mapping[str, Any] | None, what: str) -> Mapping[str, Any]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        if what == "scaler":
            raise IntegrationError(
                f"AmpConfig scaler= takes GradScaler settings as a dict, e.g. "
                f"scaler={{'init_scale': 1024.0, 'growth_interval': 2000}}, got "
                f"{type(value).__name__}: the integration makes its own mixprec.GradScaler."
            )
        raise IntegrationError(f"AmpConfig {what} must be a dict, got {type(value).__name__}.")
    return MappingProxyType(dict(value))


@dataclass(frozen=True)
class AmpConfig:
    """How an integration trains: opt level, dtype, op policy, scaler and option overrides.

    Attributes:
        opt_level: ``'O0'`` ... ``'O3'`` (``mixprec.describe(level)`` explains each).
        dtype: ``'fp16'``/``'bf16'`` (or a torch dtype); default fp16 on CUDA, bf16 elsewhere.
        policy: a `mixprec.Policy` or its string form, for O1's autocast.
        scaler: `mixprec.GradScaler` keyword arguments (``init_scale``, ``growth_interval``,
            ``hysteresis``, ``min_scale``, ...), used when the level scales the loss (fp16).
        options: ``mixprec.initialize``'s option overrides (``keep_batchnorm_fp32``,
            ``loss_scale``, ``min_loss_scale``, ...).
        hold_schedule_on_skip: wrap LR schedulers in `mixprec.SkipAwareLR` where the framework
            would step them on a skipped step (Lightning, Accelerate).
    """

    opt_level: str = "O1"
    dtype: str | torch.dtype | None = None
    policy: Policy | str | None = None
    scaler: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    hold_schedule_on_skip: bool = True

    def __post_init__(self) -> None:
        OptLevel.parse(self.opt_level)  # raises PolicyError naming the valid levels
        object.__setattr__(self, "scaler", _freeze(self.scaler, "scaler"))
        object.__setattr__(self, "options", _freeze(self.options, "options"))
        valid = _scaler_args()
        bad = sorted(set(self.scaler) - set(valid))
        if bad:
            raise IntegrationError(
                f"AmpConfig scaler={{{bad[0]!r}: ...}} is not a GradScaler argument. Valid: "
                f"{format_options(valid)}."
            )
        bad = sorted(set(self.options) - (set(OVERRIDES) - {"policy"}))
        if bad:
            raise IntegrationError(
                f"AmpConfig options={{{bad[0]!r}: ...}} is not an initialize option. Valid: "
                f"{format_options(sorted(set(OVERRIDES) - {'policy'}))} (the policy has its own "
                f"field: AmpConfig(policy=...))."
            )
        if not isinstance(self.hold_schedule_on_skip, bool):
            raise IntegrationError("AmpConfig hold_schedule_on_skip must be True or False.")
        if self.resolve("cpu").low_memory:
            # The framework builds and steps its own optimizer, which the integrations wrap but
            # do not replace: O4 would train as plain bf16 weights under torch's optimizer,
            # every update below half a bf16 ulp lost (O3), while it reports O4.
            raise IntegrationError(
                f"AmpConfig opt_level={self.opt_level!r} with low-memory weights or optimizer "
                f"states (O4, master_weights='stochastic'/'kahan'/'split', optimizer_states="
                f"'bf16'/'8bit'/'8bit-bound') is not supported by the integrations: the "
                f"framework's own optimizer would step bf16 weights by round-to-nearest. Valid "
                f"levels here: 'O0', 'O1', 'O2' or 'O3'. For O4's training state, build "
                f"mixprec.LowMemAdamW "
                f"(or LowMemAdam, LowMemSGD) in your optimizer factory (configure_optimizers) and "
                f"train at opt_level='O3', or use mixprec.initialize / mixprec.TrainStep."
            )

    def __reduce__(self) -> tuple[Any, ...]:
        # A mappingproxy cannot be pickled: rebuild from plain dicts (frozen again on the way in),
        # so that configs and the plugins holding them survive copy.deepcopy and the process
        # spawns of strategy="ddp_spawn".
        return (type(self), (self.opt_level, self.dtype, self.policy, dict(self.scaler),
                             dict(self.options), self.hold_schedule_on_skip))  # fmt: skip

    def resolve(self, device_type: str) -> AmpOptions:
        """The opt level resolved for `device_type` (what ``mixprec.describe`` prints)."""
        overrides = dict(self.options)
        if self.policy is not None:
            overrides["policy"] = self.policy
        return resolve(self.opt_level, device_type=device_type, dtype=self.dtype, **overrides)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside framework wrappers (LightningOptimizer, AcceleratedOptimizer).

    Stops at the first `AmpOptimizer` or plain torch optimizer whose wrapper chain ends.
    """
    seen: set[int] = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        wrapped = optimizer.__dict__.get("_optimizer") if hasattr(optimizer, "__dict__") else None
        if isinstance(wrapped, torch.optim.Optimizer):  # LightningOptimizer
            optimizer = wrapped
            continue
        if isinstance(optimizer, AmpOptimizer):
            return optimizer
        inner = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            return optimizer
        if type(optimizer).__module__.startswith("torch.optim"):
            return optimizer
        optimizer = inner
    return optimizer


class AmpEngine:
    """An opt level applied by a framework's hooks (see the module docstring).

    Args:
        config: the settings.
        device_type: the device the model trains on (``'cuda'``, ``'cpu'``, ...).
        outputs_fp32: in O1, also run the model's forward inside a region entered by a forward
            hook and return its floating outputs in fp32 (what Accelerate does for its own
            autocast); without it the framework enters `autocast()` itself.
        passthrough: ``passthrough(model)``, asked at a converted model's entry: True when the
            call runs not the model's forward but a method the framework routes through the
            model's call (Lightning's ``training_step`` under DDP), whose arguments and result
            O2 then leaves uncast (`mixprec.levels.model.AmpHooks.passthrough`).
    """

    def __init__(self, config: AmpConfig, device_type: str, *, outputs_fp32: bool = False,
                 passthrough: Callable[[nn.Module], bool] | None = None):  # fmt: skip
        if not isinstance(config, AmpConfig):
            raise IntegrationError(
                f"expected a mixprec.integrations.engine.AmpConfig, got {type(config).__name__}."
            )
        self.config = config
        self.options = config.resolve(device_type)
        self.device_type = self.options.device_type
        self.scaler = self._make_scaler() if self.options.uses_scaler else None
        self._outputs_fp32 = outputs_fp32
        self._passthrough = passthrough
        self._masters: dict[int, torch.Tensor] = {}  # id(param) -> its fp32 master (O2)
        self._modules: list[nn.Module] = []  # converted models
        # Their hooks, one list shared by every optimizer (`AmpOptimizer._hooks`): whether the
        # last forward ran inside DDP's no_sync(), whose gradients must wait on the weights.
        self._hooks: list[Any] = []
        self.optimizers: list[AmpOptimizer] = []
        self._sources: list[tuple[Any, AmpOptimizer]] = []  # (the user's optimizer, its wrap)
        self.sharded = False  # a converted model is sharded with FSDP2 (it owns its precision)
        self._fp32: list[tuple[nn.Module, Any]] = []  # O1: (model, its Fp32Modules)
        #: The `mixprec.Healer` (``options={'heal': True}``), made with the first optimizer.
        self.healer: Any = None

    def _make_scaler(self) -> GradScaler:
        opts = self.options
        kwargs: dict[str, Any] = {
            "init_scale": 2.0**16 if opts.dynamic_loss_scale else float(opts.loss_scale),
            "dynamic": opts.dynamic_loss_scale,
            "min_scale": opts.min_loss_scale,
            "max_scale": opts.max_loss_scale,
            "num_losses": opts.num_losses,
        }
        kwargs.update(self.config.scaler)
        return GradScaler(opts.device_type, **kwargs)

    def __repr__(self) -> str:
        return (f"AmpEngine({self.options.level.value}, {self.options.dtype}, "
                f"scaler={self.scaler is not None})")  # fmt: skip

    @property
    def low_model(self) -> bool:
        """Whether the level casts the model's weights (O2, O3)."""
        t = self.options.cast_model_type
        return t is not None and t != torch.float32

    # ------------------------------------------------------------------ forward

    def autocast(self, cache_enabled: bool | None = None) -> contextlib.AbstractContextManager:
        """The forward region: ``mixprec.autocast`` for O1, nothing for the other levels.

        `cache_enabled` as the framework's own region sets it (Lightning's Trainer turns the
        weight-cast cache off: a weight used twice then gets two casts, whose gradients add up
        in fp32, not one whose gradient adds up in the low dtype)."""
        opts = self.options
        if not opts.patch_torch_functions:
            return contextlib.nullcontext()
        return autocast(opts.device_type, dtype=opts.dtype, policy=opts.policy,
                        cache_enabled=cache_enabled)  # fmt: skip

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Apply the level to `module` in place (O2/O3: cast, fp32 norms, entry/exit hooks).

        O2 takes the fp32 masters here, before the cast. Converting twice is a no-op.
        """
        if any(m is module for m in self._modules):
            return module
        if fsdp_modules(module):  # sharded in the framework's model hook (Lightning's FSDP2)
            inside = check_sharded(module, self.options, self.config.options, self.config.policy)
            if self.options.master_weights:  # the fp32 shards are the masters: each steps itself
                self._masters.update((id(p), p) for p in module.parameters() if id(p) in inside)
            self.sharded = True
            self._modules.append(module)
            return module
        keep_fp32.check_models([module], self.options)  # before anything changes
        hooks = amp_hooks(module)
        if hooks is not None and module in _CONVERTED:
            return self._adopt(module, hooks)
        if hooks is not None:
            raise IntegrationError(
                f"{type(module).__name__} was already prepared by mixprec.initialize; with a "
                f"framework integration pass the plain fp32 model: the integration applies the "
                f"opt level itself."
            )
        opts = self.options
        if self.low_model or self._outputs_fp32:
            if self._outputs_fp32 and not self.low_model:
                opts = replace(opts, cast_model_outputs=torch.float32)
            elif not self._outputs_fp32:
                opts = replace(opts, patch_torch_functions=False)
            _prepare_model(module, opts, self._masters)
        self._modules.append(module)
        # O1: the policy's fp32 modules and healing's moves (the framework opens the region).
        own = amp_hooks(module)
        if own is not None:
            own.passthrough = self._passthrough
            self._hooks.append(own)
            _CONVERTED[module] = (self._conversion(), self._masters)
        fp32 = own.fp32 if own is not None else keep_fp32.install(module, None, self.options)
        if fp32 is not None:
            self._fp32.append((module, fp32))
        return module

    def _conversion(self) -> tuple[Any, ...]:
        """What `convert_module` did to a model: what a later engine must agree with."""
        o = self.options
        return (o.level.value, o.dtype, o.cast_model_type, o.keep_batchnorm_fp32,
                o.master_weights, self._outputs_fp32)  # fmt: skip

    def _adopt(self, module: nn.Module, hooks: Any) -> nn.Module:
        """Take over `module`, converted by another engine (an earlier Trainer's plugin): its
        weights are cast already and its fp32 masters are that engine's, so they are shared,
        not taken again from the cast weights (which would round them to the low dtype)."""
        done, masters = _CONVERTED[module]
        if done != self._conversion():
            level, dtype = done[0], str(done[1]).replace("torch.", "")
            raise IntegrationError(
                f"{type(module).__name__} was converted to {level} ({dtype}) by another mixprec "
                f"plugin (an earlier Trainer's or Fabric's): its weights are cast already. Use "
                f"the same opt level and dtype for every run on this model, or build a fresh "
                f"model (or load its fp32 checkpoint into one) for another setting."
            )
        for p in module.parameters():
            if id(p) in masters:
                self._masters[id(p)] = masters[id(p)]
        hooks.passthrough = self._passthrough
        self._hooks.append(hooks)
        if hooks.fp32 is not None:
            self._fp32.append((module, hooks.fp32))
        self._modules.append(module)
        _CONVERTED[module] = (done, self._masters)
        return module

    def forget_optimizers(self, keep: list[Any]) -> None:
        """Drop the optimizers wrapped so far except `keep` (theirs or their wraps): the
        framework replaced the others (Lightning builds new ones at every ``fit``), which, left
        here, were still flagged at every backward and kept their state alive."""
        ids = {id(unwrap_optimizer(opt)) for opt in keep}
        self._sources = [(src, amp) for src, amp in self._sources
                         if ids & {id(src), id(amp), id(amp.optimizer)}]  # fmt: skip
        self.optimizers[:] = [amp for _, amp in self._sources]

    # ------------------------------------------------------------------ optimizers

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> AmpOptimizer:
        """`optimizer` as an `AmpOptimizer` of this level (over the fp32 masters in O2).

        In O2 the model must have been converted first (its masters are taken before the cast).
        """
        if isinstance(optimizer, AmpOptimizer):
            if optimizer in self.optimizers:
                return optimizer
            raise IntegrationError(
                "this optimizer was returned by mixprec.initialize; with a framework integration "
                "pass the plain torch optimizer: the integration wraps it."
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise IntegrationError(
                f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}."
            )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.options.master_weights:
            missing = [p for p in params if p.is_floating_point() and id(p) not in self._masters]
            if missing:
                raise IntegrationError(
                    f"{self.options.level.value} keeps fp32 master weights, taken when the model "
                    f"is converted; {len(missing)} parameter(s) of this optimizer belong to no "
                    f"converted model. Set up (prepare) the model before, or together with, its "
                    f"optimizer."
                )
            # Sharded: the user's optimizer already steps the fp32 shards (the masters).
            inner = optimizer if self.sharded else build_inner(optimizer, self._masters)
        else:
            inner = optimizer
        mine = {id(p) for g in inner.param_groups for p in g["params"]}
        pairs = [(p, self._masters[id(p)]) for p in params
                 if id(p) in self._masters and self._masters[id(p)] is not p
                 and id(self._masters[id(p)]) in mine]  # fmt: skip
        for low, master in pairs:
            if master.device != low.device:  # the model moved after its masters were taken
                master.data = master.data.to(low.device)
        amp = AmpOptimizer(inner, self.options, LossScaling(self.scaler, eager_update=True),
                           [lo for lo, _ in pairs], [m for _, m in pairs])  # fmt: skip
        # (O2) Backwards under DDP's no_sync() leave their gradients on the weights, for DDP's
        # next synchronised backward to reduce (the models' hooks say; shared, so a model
        # converted later counts too).
        amp._hooks = self._hooks
        self.optimizers.append(amp)
        self._sources.append((optimizer, amp))
        if self.healer is None:
            self.healer = make_healer(self._fp32, self.scaler, self.options)
            if self.healer is not None:
                self.healer.on_change(self._follow_moves)
        amp._scaling.healer = self.healer
        return amp

    def _follow_moves(self, healer: Any) -> None:
        # describe() and the optimizers' options show the policy with healing's moves.
        self.options = replace(self.options, policy=healer.policy)
        for amp in self.optimizers:
            amp.options = replace(amp.options, policy=healer.policy)

    def amp_for(self, optimizer: Any) -> AmpOptimizer | None:
        """The `AmpOptimizer` made from `optimizer` (or that is, or wraps, it); None if none."""
        inner = unwrap_optimizer(optimizer)
        for source, amp in self._sources:
            if inner is source or inner is amp or inner is amp.optimizer:
                return amp
        return None

    def _amp(self, optimizer: Any) -> Any:
        """`optimizer`'s `AmpOptimizer`, through framework wrappers, and from the user's optimizer
        where the framework holds that one (sharded models); else what `unwrap_optimizer` finds."""
        inner = unwrap_optimizer(optimizer)
        if isinstance(inner, AmpOptimizer):
            return inner
        return self.amp_for(inner) or inner

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer steps for `param` (its fp32 master in O2, else itself)."""
        return self._masters.get(id(param), param)

    # ------------------------------------------------------------------ backward

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Start a backward: the loss times the scale (fp16), as it is (bf16). No sync."""
        if self.scaler is not None:
            for amp in self.optimizers:
                state = self.scaler._per_optimizer.get(id(amp.optimizer))
                if state is not None and state.found_inf is not None:
                    # torch's GradScaler raises here too (unscale_ already called since the
                    # last update); going on would add scaled gradients to unscaled ones.
                    raise IntegrationError(
                        "a backward started after this iteration's gradients were unscaled "
                        "(clip_grad_norm_ or unscale_ on an earlier micro-batch): its "
                        "gradients would be added, still scaled, to unscaled ones. Clip once "
                        "per optimizer step, after the last micro-batch (with Accelerate: "
                        "`if accelerator.sync_gradients: accelerator.clip_grad_norm_(...)`)."
                    )
        new_iteration = not any(amp._scaling.scaled for amp in self.optimizers)
        if new_iteration and self.options.master_weights and not self.sharded:
            # Frameworks clear the model's gradients (Transformers: model.zero_grad()), not
            # necessarily the optimizer's: the masters' are stale from the last step.
            for amp in self.optimizers:
                amp.optimizer.zero_grad(set_to_none=True)
        for amp in self.optimizers:
            amp._scaling.scaled = True  # the loss of this iteration is scaled (by us)
            if self.options.master_weights and not self.sharded:
                # As scale_loss: the first backward after a step drops the masters' gradients
                # of that step (the framework may clear only the model's: Transformers'
                # model.zero_grad()); a later one adds an earlier micro-batch's into them in
                # fp32, except under no_sync(), where they stay for DDP to reduce.
                amp._start_backward()
            elif not amp._held:
                amp._after_backward()
        return loss if self.scaler is None else self.scaler.scale(loss)

    def after_backward(self) -> None:
        """End a backward: in O2, add the low-precision gradients into the fp32 masters (bf16:
        when the step or clipping needs them, `AmpOptimizer._after_backward`)."""
        if self.options.master_weights:
            for amp in self.optimizers:
                amp._after_backward(defer=self.scaler is None)

    # ------------------------------------------------------------------ step

    def unscale_(self, optimizer: Any) -> None:
        """Divide `optimizer`'s gradients by the scale, once per iteration (to clip, inspect)."""
        amp = self._amp(optimizer)
        if isinstance(amp, AmpOptimizer):
            # (O2) into the masters, where clipping reads them (`master_of`): gradients a bf16
            # backward left on the model, or of a backward that bypassed after_backward.
            amp._after_backward()
        if self.scaler is None or not isinstance(amp, AmpOptimizer):
            return
        inner = amp.optimizer
        # Once per iteration: the scaler's own stage machine knows (reset by update()).
        state = self.scaler._per_optimizer.get(id(inner))
        if state is not None and state.found_inf is not None:
            return
        if not any(p.grad is not None for g in inner.param_groups for p in g["params"]):
            return
        self.scaler.unscale_(inner)

    def main_params(self, optimizer: Any) -> Iterator[torch.Tensor]:
        """The tensors `optimizer` steps (fp32 masters in O2): what clipping must act on."""
        for group in self._amp(optimizer).param_groups:  # (O2: moves a bf16 backward's grads)
            yield from group["params"]

    def clip_grad_norm_(self, optimizer: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        """Unscale, then clip the norm of the stepped tensors' gradients; return the norm."""
        self.unscale_(optimizer)
        return torch.nn.utils.clip_grad_norm_(list(self.main_params(optimizer)), max_norm,
                                              norm_type=norm_type)  # fmt: skip

    def step(self, optimizer: Any, closure: Any = None, **kwargs: Any) -> Any:
        """The scaled optimizer step (skipped on the device on overflow) and the scale update.

        Keyword arguments go to the optimizer's ``step``; a closure only where nothing is
        scaled or kept as masters (`AmpOptimizer.step`).
        """
        amp = self._amp(optimizer)
        if not isinstance(amp, AmpOptimizer) or amp not in self.optimizers:
            raise IntegrationError(
                f"{type(amp).__name__} was not set up by this mixprec integration: pass every "
                f"optimizer through it (the precision plugin's connect/initialize, or "
                f"accelerator.prepare)."
            )
        return amp.step(closure, **kwargs)

    def takes_closure(self, optimizer: Any) -> bool:
        """Whether `optimizer`'s step can run a closure: no loss scaling and no fp32 masters (a
        closure inside the step could be neither scaled nor moved into the masters)."""
        amp = self._amp(optimizer)
        return self.scaler is None and not (isinstance(amp, AmpOptimizer) and amp._low)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped (overflow). One host-device sync per read."""
        return False if self.scaler is None else self.scaler.last_step_skipped

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (masters and optimizer state live in each `AmpOptimizer`'s)."""
        return {
            "format": FORMAT,
            "opt_level": self.options.level.value,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "heal": None if self.healer is None else self.healer.state_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict()``'s output; checked before anything changes."""
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != FORMAT:
            raise IntegrationError(
                f"not a mixprec integration state dict (format {FORMAT!r} expected); it holds "
                f"keys {sorted(state_dict)[:6] if isinstance(state_dict, Mapping) else '?'}."
            )
        level = self.options.level.value
        if state_dict.get("opt_level") != level:
            raise IntegrationError(
                f"the checkpoint was trained at {state_dict.get('opt_level')!r}, this run uses "
                f"{level!r}: resume with the same opt level."
            )
        sd = state_dict.get("scaler")
        if (sd is None) != (self.scaler is None):
            raise IntegrationError(
                "the checkpoint's loss scaling differs from this run's (one scales the loss, the "
                "other does not): resume with the same dtype and loss_scale."
            )
        heal = state_dict.get("heal")
        if self.healer is None and isinstance(heal, Mapping) and heal.get("moves"):
            raise IntegrationError(
                f"the checkpoint was trained with healing, which moved "
                f"{[m.get('module') for m in heal['moves']]} to fp32: resume with "
                f"options={{'heal': True}} (or a policy that keeps them: "
                f"mixprec.Policy().keep_fp32(...))."
            )
        if self.healer is not None and heal is not None:
            try:
                self.healer.check_state(dict(heal))
            except MixprecError as err:
                raise IntegrationError(f"the checkpoint's healing state is refused: {err}") from err
        if self.scaler is not None:
            self.scaler.load_state_dict(dict(sd))
        if self.healer is not None and heal is not None:
            self.healer.load_state_dict(dict(heal))
