"""Apex's ``amp`` namespace for the adapted Apex tests: mixprec's Apex-compatible API.

The adapted tests change only their imports (``from apex import amp`` becomes
``from tests.peers.apex import amp``) and their device. Everything they call here is mixprec's
public API, except what reads or writes Apex's *global* state, which mixprec does not have:

- ``_amp_state.loss_scalers[i]`` (``loss_scale()``, ``_loss_scale``, ``_unskipped``): loss `i`'s
  scale and growth counter in the scaler of the optimizer(s) the last ``initialize`` returned,
  read with ``optimizer.scaler.stats()`` (after ``optimizer.loss_scale``, which runs the
  deferred update) and set with ``scaler.load_state_dict`` (in the middle of an iteration,
  where that is refused, loss 0's with ``scaler.update(new_scale=...)``). Without a scaler (O0,
  O3: Apex's static scale 1.0) a set value is only recorded: Apex scaled by it and unscaled by
  it again, which changes nothing the tests check (their scales are powers of two).
- ``amp.state_dict()``: Apex's per-loss ``{'loss_scale', 'unskipped'}`` built from the same;
  ``amp.load_state_dict(sd)``: ``scaler.load_state_dict(sd)``, which reads Apex's format.
- ``_amp_state.opt_properties``: the `AmpOptions` the last ``initialize`` resolved.
- ``amp.init()`` (Apex's older handle API for O1's casts): a ``mixprec.autocast`` region, entered
  by ``init`` and left by ``handle._deactivate()``; ``allow_banned=True`` moves the banned ops to
  fp32, which is what Apex did with them.
- ``_amp_state.allow_incoming_model_not_fp32``, ``handle._clear_cache()``: Apex internals with
  no mixprec counterpart; recorded or no-ops.

Device: Apex's tests ran on CUDA in fp16. Here they run on the CPU in fp16 (``dtype=fp16``),
with the CUDA op table (``Policy(table='cuda')``), so each op gets the rule it had on the GPU.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

import mixprec
from mixprec import Policy, ScalerCheckpointError

DEVICE = "cpu"
DTYPE = torch.float16
POLICY = Policy(table="cuda")
#: The ops Apex's O1 refused (its "banned" list); ``allow_banned=True`` runs them in fp32.
BANNED = ("binary_cross_entropy",)

scale_loss = mixprec.scale_loss
master_params = mixprec.master_params


def initialize(models: Any, optimizers: Any = None, **kwargs: Any) -> Any:
    """``mixprec.initialize`` in fp16 with the CUDA op table; remembered for `_amp_state`."""
    kwargs.setdefault("dtype", DTYPE)
    kwargs.setdefault("policy", POLICY)
    out = mixprec.initialize(models, optimizers, **kwargs)
    opts = out[1] if optimizers is not None else None
    _amp_state.record(opts, kwargs)
    return out


def load_state_dict(state_dict: dict) -> None:
    """Apex's ``amp.load_state_dict``: into the scaler of the last initialize (mixprec's
    ``GradScaler.load_state_dict`` reads Apex's format)."""
    opt = _amp_state.optimizer
    if opt is not None and opt.scaler is not None and opt.scaler.is_enabled():
        opt.loss_scale  # noqa: B018  (runs the update deferred to the next iteration)
        opt.scaler.load_state_dict(state_dict)


def state_dict() -> OrderedDict:
    """Apex's ``amp.state_dict()``: per loss, its scale and its count of clean updates."""
    out: OrderedDict = OrderedDict()
    for i, view in enumerate(_amp_state.loss_scalers):
        out[f"loss_scaler{i}"] = {"loss_scale": view.loss_scale(), "unskipped": view._unskipped}
    return out


class _Handle:
    """Apex's ``AmpHandle``: here an open ``mixprec.autocast`` region."""

    def __init__(self, policy: Policy) -> None:
        self._region = mixprec.autocast(DEVICE, dtype=DTYPE, policy=policy)
        self._region.__enter__()
        self._active = True

    def _deactivate(self) -> None:
        if self._active:
            self._region.__exit__(None, None, None)
            self._active = False

    def _clear_cache(self) -> None:
        pass  # mixprec's region keeps no cast cache across calls


class _NoHandle:
    def _deactivate(self) -> None:
        pass

    def _clear_cache(self) -> None:
        pass


def init(enabled: bool = True, allow_banned: bool = False, **_: Any) -> Any:
    """Apex's ``amp.init``: open an O1 cast region (CUDA rules, fp16) until ``_deactivate``."""
    if not enabled:
        return _NoHandle()
    policy = POLICY
    if allow_banned:
        for op in BANNED:
            policy = policy.move(op, to="fp32")
    handle = _Handle(policy)
    _amp_state.handle = handle
    return handle


class _LossScalerView:
    """``_amp_state.loss_scalers[i]``: loss `i` of the last initialize's scaler."""

    def __init__(self, state: _AmpState, index: int) -> None:
        self._state = state
        self._index = index

    def _scaler(self) -> Any:
        opt = self._state.optimizer
        if opt is None or opt.scaler is None or not opt.scaler.is_enabled():
            return None
        opt.loss_scale  # noqa: B018  (runs the update deferred to the next iteration)
        return opt.scaler

    def _fields(self) -> dict[str, Any] | None:
        scaler = self._scaler()
        return None if scaler is None else scaler.stats()["losses"][self._index]

    def _set(self, **fields: Any) -> None:
        scaler = self._scaler()
        if scaler is None:
            self._state.static.update(fields)
            return
        sd = scaler.state_dict()
        entry = sd["losses"][self._index] if "losses" in sd else sd
        for key, value in fields.items():
            entry[key] = value
            if self._index == 0 and "losses" in sd and key in ("scale", "growth_tracker"):
                sd["_growth_tracker" if key == "growth_tracker" else key] = value
        if "growth_tracker" in fields and "losses" not in sd:
            sd["_growth_tracker"] = fields["growth_tracker"]
        try:
            scaler.load_state_dict(sd)
        except ScalerCheckpointError:
            # In the middle of an iteration (test_cache unscales without stepping). Apex set
            # the attribute whenever asked; mixprec's way to set a scale there is update().
            if self._index != 0 or set(fields) != {"scale"}:
                raise
            scaler.update(new_scale=fields["scale"])

    @property
    def dynamic(self) -> bool:
        scaler = self._scaler()
        return scaler is not None and scaler.config.dynamic

    def loss_scale(self) -> float:
        fields = self._fields()
        return float(self._state.static.get("scale", 1.0) if fields is None else fields["scale"])

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self._set(scale=float(value))

    @property
    def _unskipped(self) -> int:
        fields = self._fields()
        return 0 if fields is None else int(fields["growth_tracker"])

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self._set(growth_tracker=int(value))


class _AmpState:
    """Apex's ``_amp_state``, answered from the last ``initialize`` (mixprec keeps no globals)."""

    def __init__(self) -> None:
        self.allow_incoming_model_not_fp32 = False
        self.hard_override = False
        self.verbosity = 1
        self.handle: Any = _NoHandle()
        self.optimizer: Any = None
        self.num_losses = 1
        self.opt_properties: Any = None
        self.static: dict[str, Any] = {}

    def record(self, optimizers: Any, kwargs: dict[str, Any]) -> None:
        opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.optimizer = opts[0]
        self.num_losses = kwargs.get("num_losses", 1)
        self.static = {}
        self.opt_properties = getattr(self.optimizer, "options", None)

    @property
    def loss_scalers(self) -> list[_LossScalerView]:
        return [_LossScalerView(self, i) for i in range(self.num_losses)]


_amp_state = _AmpState()
