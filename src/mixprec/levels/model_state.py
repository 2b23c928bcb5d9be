"""A cast model's ``state_dict``: fp32 out, and loading refreshes the fp32 master weights.

After O2/O3 the model's weights are low precision, but checkpoints should not change dtype with
the opt level (Apex returned fp32 here, and checkpoints written under Apex are fp32). So a model
whose weights ``initialize`` cast gets, on each of its modules, a pair of state-dict hooks:

- ``state_dict()`` returns fp32 tensors for the module's low-precision parameters and buffers:
  a parameter's **fp32 master weight** where it has one (O2: the value the optimizer steps, which
  the low-precision weight is a rounding of), the tensor cast to fp32 otherwise (O3, buffers).
  With ``keep_vars=True`` the live tensors are returned as they are (tools that need the
  objects themselves, such as `mixprec.save_checkpoint`, ask for them). Cost: one fp32 copy per
  cast tensor without a master; masters are returned without a copy (detached, as torch returns
  parameters).
- ``load_state_dict(sd)`` copies each low-precision weight's entry into its master too (torch
  already copies it into the weight, casting), so loading a checkpoint after ``initialize``, in
  Apex's documented order (initialize, then load the model, the optimizer and the scaler),
  leaves masters and weights in agreement, and an fp32 checkpoint keeps its full precision in
  the masters. ``assign=True`` is refused: it would replace the parameters the optimizer and
  the masters refer to.

Masters are looked up through a `MasterMap` of weak references, so a model initialized without
an optimizer (its masters discarded) casts instead, and a copy of the model (other parameter
objects) never reads the original's masters.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from mixprec.errors import UsageError

__all__ = ["MasterMap", "register_state_hooks"]


class MasterMap:
    """The fp32 master of each low-precision weight of one ``initialize`` call (weakly held)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # A copy or pickle of the model (EMA/SWA's deepcopy, torch.save(model)) has weights
        # of its own, which no optimizer's masters track: its state dict reads its weights.
        return {"_by_id": {}}

    def add(self, low: torch.Tensor, master: torch.Tensor) -> None:
        """Record `master` as the master of `low`."""
        self._by_id[id(low)] = (weakref.ref(low), weakref.ref(master))

    def get(self, low: torch.Tensor) -> torch.Tensor | None:
        """The master of `low`, if it has one that is still alive."""
        entry = self._by_id.get(id(low))
        if entry is None or entry[0]() is not low:
            return None
        return entry[1]()


def register_state_hooks(model: nn.Module, low: torch.dtype, masters: MasterMap) -> list[Any]:
    """Put the fp32 state-dict hooks on every module of `model`; return their handles."""
    handles = []
    for module in model.modules():
        load = _LoadIntoMasters(masters)
        handles += [
            module.register_state_dict_post_hook(_Fp32StateDict(low, masters)),
            module.register_load_state_dict_pre_hook(load),
            module.register_load_state_dict_post_hook(load.commit),
        ]
    return handles


class _Fp32StateDict:
    """State-dict post-hook: the module's own low-precision entries as fp32 (masters first)."""

    def __init__(self, low: torch.dtype, masters: MasterMap) -> None:
        self.low = low
        self.masters = masters

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        own = [(n, t, True) for n, t in module.named_parameters(recurse=False)]
        own += [(n, t, False) for n, t in module.named_buffers(recurse=False)]
        for name, tensor, is_param in own:
            key = prefix + name
            value = state_dict.get(key)
            # `value is tensor`: state_dict(keep_vars=True), which asks for the live objects.
            if not isinstance(value, torch.Tensor) or value is tensor or tensor.dtype != self.low:
                continue
            master = self.masters.get(tensor) if is_param else None
            state_dict[key] = master.detach() if master is not None else value.float()


class _LoadIntoMasters:
    """Load pre-hook (note each weight's entry) and post-hook (copy the entries into masters)."""

    def __init__(self, masters: MasterMap) -> None:
        self.masters = masters
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, metadata: dict,
                 strict: bool, missing: list, unexpected: list, errors: list) -> None:  # fmt: skip
        if metadata.get("assign_to_params_buffers"):
            raise UsageError(
                f"{type(module).__name__}.load_state_dict(..., assign=True) would replace the "
                f"parameters of a model mixprec.initialize cast (the optimizer and the fp32 "
                f"master weights refer to them). Load without assign=True: the values are "
                f"copied into the existing parameters, cast to their dtype."
            )
        self.pending = []
        for name, param in module.named_parameters(recurse=False):
            master = self.masters.get(param)
            value = state_dict.get(prefix + name)
            # torch copies an entry of the right shape into the weight; anything else it
            # reports as an error and leaves the weight alone, and so do we with the master.
            if (
                master is not None
                and isinstance(value, torch.Tensor)
                and (value.shape == param.shape)
            ):
                self.pending.append((master, value))

    def commit(self, module: nn.Module, incompatible: Any) -> None:
        pending, self.pending = self.pending, []
        with torch.no_grad():
            for master, value in pending:
                master.copy_(value)
