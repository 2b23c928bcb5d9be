"""`memory_report`: the bytes of training state per parameter, by component, from the tensors.

What counts as training state: every tensor that lives from one step to the next and grows
with the model: the model's weights, the gradients held after backward (the model's and, in
O2, the fp32 masters'), fp32 master weights, the optimizer's state (moments, quantized codes),
the block scales of quantized states, compensation buffers, step counters and rounding keys,
and the snapshot a device-side overflow skip keeps between steps. Activations are not training
state (they depend on the batch; see ``mixprec bench``'s peak-memory column for those).

Exact: each tensor's storage is counted once (`untyped_storage().nbytes()`, deduplicated by
address, so a weight that is its own master, or views of one buffer, count once), whatever its
dtype or layout (a tensor subclass, such as another library's quantized state, is counted by
the tensors it holds). Call it after backward and before ``step`` (or after a `mixprec.TrainStep`
call, which keeps its gradients until the next step) to see the largest point of the cycle.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._compat import local_tensor
from mixprec.errors import ArgumentTypeError

__all__ = ["COMPONENTS", "MemoryReport", "memory_report", "state_tensors"]

#: The components, in the order they are reported.
COMPONENTS = (
    "weights",
    "gradients",
    "masters",
    "optimizer states",
    "block scales",
    "compensation",
    "counters",
    "skip snapshot",
)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of training state by component (`COMPONENTS`), over `params` parameters."""

    params: int
    bytes: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """All training state, bytes."""
        return sum(self.bytes.values())

    def per_param(self, component: str | None = None) -> float:
        """Bytes per parameter of one component, or of all of them (None)."""
        if component is not None and component not in COMPONENTS:
            raise ArgumentTypeError(
                f"unknown component {component!r}; valid: {', '.join(COMPONENTS)}."
            )
        held = self.total if component is None else self.bytes.get(component, 0)
        return held / self.params if self.params else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers, for JSON: per-component bytes and bytes per parameter."""
        return {
            "params": self.params,
            "bytes": dict(self.bytes),
            "bytes_per_param": {k: round(self.per_param(k), 4) for k in self.bytes},
            "total_bytes_per_param": round(self.per_param(), 4),
            "dtypes": {k: dict(v) for k, v in self.dtypes.items()},
        }

    def __str__(self) -> str:
        lines = [
            f"training state: {self.per_param():.3f} bytes/parameter over {self.params:,} "
            f"parameters ({self.total / 2**20:.2f} MiB)"
        ]
        for name in COMPONENTS:
            if self.bytes.get(name):
                kinds = ", ".join(f"{d} {n / 2**20:.2f} MiB" for d, n in self.dtypes[name].items())
                lines.append(f"  {name:17s} {self.per_param(name):7.3f} B/param  ({kinds})")
        return "\n".join(lines)


def memory_report(model: nn.Module, optimizer: Any = None) -> MemoryReport:
    """The training state of `model` and `optimizer`, exactly, by component.

    `optimizer` is a torch optimizer, an `AmpOptimizer` (its fp32 masters, their gradients,
    its inner optimizer's state and its scaler's skip snapshot are counted), or None (weights
    and gradients only). Under FSDP2 each rank counts its own shards (bytes per parameter of
    its shard). Cost: a pass over the tensors; no device sync.
    """
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"memory_report expects an nn.Module, got {type(model).__name__}.")
    seen: set[tuple[str, int]] = set()
    held: dict[str, int] = {}
    dtypes: dict[str, dict[str, int]] = {}
    for component, t in state_tensors(model, optimizer):
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen and storage.nbytes():
            continue
        seen.add(key)
        n = storage.nbytes()
        held[component] = held.get(component, 0) + n
        name = str(t.dtype).replace("torch.", "")
        dtypes.setdefault(component, {})[name] = dtypes.get(component, {}).get(name, 0) + n
    numel = sum(local_tensor(p).numel() for p in model.parameters())
    ordered = {k: held[k] for k in COMPONENTS if k in held}
    return MemoryReport(numel, ordered, {k: dtypes[k] for k in ordered})


def state_tensors(model: nn.Module, optimizer: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of training state (see `memory_report`) with its component, each as the
    plain tensor that owns the storage: a DTensor's local shard, a tensor subclass opened up
    into the tensors it holds. A storage met twice is yielded twice (callers deduplicate)."""

    def plain(component: str, tensor: Any) -> Iterator[tuple[str, torch.Tensor]]:
        if not isinstance(tensor, torch.Tensor):
            return
        t = local_tensor(tensor)
        if hasattr(type(t), "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
            # A tensor subclass (another library's quantized state): what it holds.
            for name in t.__tensor_flatten__()[0]:
                yield from plain(component, getattr(t, name))
            return
        yield component, t

    params = list(model.parameters())
    for p in params:
        yield from plain("weights", p)
    for p in params:
        yield from plain("gradients", p.grad)
    inner = optimizer
    if optimizer is not None and hasattr(optimizer, "_masters") and hasattr(optimizer, "optimizer"):
        for m in optimizer._masters:
            yield from plain("masters", m)
            yield from plain("gradients", m.grad)
        inner = optimizer.optimizer
        scaler = getattr(optimizer, "scaler", None)
        guard = scaler._known_guard(inner) if scaler is not None else None
        for t in getattr(guard, "_snapshot", ()) or ():
            yield from plain("skip snapshot", t)
    if inner is not None:
        for group in getattr(inner, "param_groups", ()):
            for p in group["params"]:
                yield from plain("masters", p)  # a stepped tensor that is not the model's (O2)
                yield from plain("gradients", p.grad)
        for state in getattr(inner, "state", {}).values():
            for key, value in state.items():
                yield from plain(_component(str(key), value), value)


def _component(key: str, value: Any) -> str:
    if key.endswith("_absmax"):
        return "block scales"
    if key == "comp":
        return "compensation"
    if key == "lo":
        return "masters"  # the low 16 bits of a split fp32 master
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return "counters"
    return "optimizer states"
