"""Capturing a whole training step as a CUDA graph, and knowing when a captured graph is stale.

A CUDA graph records the kernels one call of the step launches, with every pointer and every
Python scalar baked in, and replays them for the cost of one launch. That makes three rules:

- **Static inputs.** The batch is copied into buffers the graph read during capture; each input
  signature (shapes, dtypes, devices, the non-tensor values and the nesting) gets its own graph.
- **Static state.** Everything the step touches must live on the GPU at fixed addresses: the
  optimizer state (Adam's step counter too: ``capturable=True``), the scaler state, the
  gradients (allocated once, inside the graph's memory pool). A state tensor left on the CPU
  would be updated once, at capture, and never again: such steps are refused, not captured.
- **Baked hyperparameters.** A learning rate held as a Python float is a kernel argument. A
  graph is valid only while the optimizer's hyperparameters, the scaler's rule, the set of
  trainable parameters, the train/eval flag and the identity of the state tensors are those it
  was captured with; `Fingerprint` holds them and `Fingerprint.diff` says what changed. Where
  an optimizer can read its lr from a device tensor (Adam and AdamW with ``capturable``, any
  fused optimizer), `prepare` puts it there, so LR schedulers update it without a re-capture.

The backend (`CudaGraphs`) is an object so that tests without a GPU can substitute one that
runs the step instead of recording it; everything else here is plain Python over the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mixprec.scaling.schedule import reads_device_lr

__all__ = [
    "CudaGraphs",
    "Fingerprint",
    "StepGraph",
    "batch_signature",
    "capture_blocker",
    "fingerprint",
    "prepare",
]


# --------------------------------------------------------------------------- input signature


def batch_signature(batch: tuple[Any, ...], device: torch.device) -> tuple[Any, str]:
    """The key a graph is cached under for `batch`, or ``(None, why it cannot be captured)``."""
    leaves, spec = tree_flatten(batch)
    key: list[Any] = [str(spec)]
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.device != device:
                return None, (
                    f"batch tensor {i} is on {leaf.device}, the model on {device}: a graph can "
                    f"only read inputs on its own device. Move the batch there first (pin_memory "
                    f"and .to({str(device)!r}, non_blocking=True) keep that asynchronous)."
                )
            if leaf.requires_grad:
                return None, f"batch tensor {i} requires grad; inputs of a captured step cannot."
            key.append((tuple(leaf.shape), leaf.dtype, leaf.stride()))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None, (
                    f"batch element {i} ({type(leaf).__name__}) is neither a tensor nor "
                    f"hashable, so no graph can be keyed on it."
                )
            key.append(("value", type(leaf).__name__, leaf))
    return tuple(key), ""


def describe_signature(key: tuple[Any, ...]) -> str:
    """``'[64x1x8x8 float32, 64 int64]'`` for a `batch_signature` key."""
    parts = []
    for item in key[1:]:
        if item[0] == "value":
            parts.append(repr(item[2]))
        else:
            shape, dtype, _ = item
            parts.append(f"{'x'.join(map(str, shape)) or 'scalar'} {str(dtype).split('.')[-1]}")
    return "[" + ", ".join(parts) + "]"


# --------------------------------------------------------------------------- staleness


@dataclass(frozen=True)
class Fingerprint:
    """What a captured step bakes in; a graph is replayed only under an equal fingerprint."""

    hyperparameters: tuple[tuple[tuple[str, Any], ...], ...]  # per param group, non-tensor
    trainable: tuple[bool, ...]  # requires_grad of every parameter the optimizer steps
    training: bool  # the model's train/eval flag
    scaler_rule: Any  # the scaler's ScaleConfig (None without a scaler)
    identity: tuple[int, ...] = field(compare=True)  # ids of the state containers

    def diff(self, other: Fingerprint) -> str:
        """What changed from `self` to `other`, in words (the first few differences)."""
        changes: list[str] = []
        if len(self.hyperparameters) != len(other.hyperparameters):
            changes.append(
                f"param groups {len(self.hyperparameters)} -> {len(other.hyperparameters)}"
            )
        else:
            pairs = zip(self.hyperparameters, other.hyperparameters, strict=True)
            for i, (old, new) in enumerate(pairs):
                before, after = dict(old), dict(new)
                for name in sorted(set(before) | set(after)):
                    if before.get(name) != after.get(name):
                        changes.append(
                            f"{name} of param group {i} ({before.get(name)!r} -> "
                            f"{after.get(name)!r})"
                        )
        if self.trainable != other.trainable:
            changes.append("which parameters require grad")
        if self.training != other.training:
            changes.append(f"model.training ({self.training} -> {other.training})")
        if self.scaler_rule != other.scaler_rule:
            changes.append("the loss scaler's growth/backoff rule")
        if self.identity != other.identity:
            changes.append("the optimizer or scaler state objects (a state dict was loaded)")
        return ", ".join(changes[:4]) + (", ..." if len(changes) > 4 else "")


def _plain(value: Any) -> Any:
    # Hyperparameters compared by value; tuples (betas) stay tuples, tensors are skipped by the
    # caller because a device tensor is read at replay time, not baked.
    return tuple(value) if isinstance(value, list) else value


def fingerprint(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, scaler: Any
) -> Fingerprint:
    """The `Fingerprint` of a step over `optimizer` (the one whose ``step`` runs) and `model`.

    Cost: a pass over the param groups' entries and the parameters' flags (microseconds; no
    device access).
    """
    groups = tuple(
        tuple((k, _plain(v)) for k, v in group.items()
              if k != "params" and not isinstance(v, torch.Tensor))
        for group in optimizer.param_groups
    )  # fmt: skip
    trainable = tuple(p.requires_grad for g in optimizer.param_groups for p in g["params"])
    losses = getattr(scaler, "_losses", None)
    identity = (
        id(optimizer.state),
        *(id(g) for g in optimizer.param_groups),
        id(losses),
        *(id(t) for loss in losses or () for t in loss.state),
    )
    rule = scaler.config if scaler is not None and scaler.is_enabled() else None
    return Fingerprint(groups, trainable, model.training, rule, identity)


# --------------------------------------------------------------------------- preparation


def prepare(optimizer: torch.optim.Optimizer, device: torch.device) -> list[str]:
    """Make `optimizer` capturable where it can be; return a note per change (with the reason).

    - ``capturable=True`` on groups that have the flag (Adam, AdamW, RAdam, ...): their step
      counters move to the GPU, where a replay can advance them;
    - the lr of Adam/AdamW (capturable) and of fused optimizers becomes a 0-dim tensor on the
      device, which LR schedulers update in place, so a schedule does not force a re-capture.

    Numerics: capturable Adam computes its bias corrections on the device in fp32, where the
    default path uses Python floats; results can differ from an uncapturable optimizer in the
    last bits (eager and captured TrainStep steps use the same settings, so they agree).
    """
    notes: list[str] = []
    name = type(optimizer).__name__
    for i, group in enumerate(optimizer.param_groups):
        # torch refuses to record step() of a group without the flag, fused ones included.
        if "capturable" in group and not group["capturable"]:
            group["capturable"] = True
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                step = state.get("step")
                if isinstance(step, torch.Tensor) and step.device != p.device:
                    state["step"] = step.to(device=p.device, dtype=torch.get_default_dtype())
            notes.append(
                f"{name} param group {i}: capturable=True (its step counter must live on the "
                f"GPU for a replay to advance it)"
            )
            # The warm-up steps run uncaptured by design: torch's warning about capturable
            # optimizers stepping outside a capture does not apply.
            optimizer._warned_capturable_if_run_uncaptured = True  # type: ignore[attr-defined]
        lr = group.get("lr")
        if isinstance(lr, float) and reads_device_lr(optimizer, group):
            group["lr"] = torch.tensor(lr, dtype=torch.float32, device=device)
            notes.append(
                f"{name} param group {i}: lr held as a device tensor (LR schedulers update it "
                f"in place; no re-capture when it changes)"
            )
    return notes


def capture_blocker(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """Why a step of `optimizer` cannot be captured on `device`, or None if it can.

    Checked after the first eager step, when the optimizer state exists.
    """
    name = type(optimizer).__name__
    # Collectives (DDP, the scaler's agreement) follow their own rules: mixprec.distributed.ddp.
    for group in optimizer.param_groups:
        for key in ("differentiable",):
            if group.get(key):
                return f"{name} runs with {key}=True, which cannot be captured"
        for p in group["params"]:
            if p.device != device:
                return f"{name} steps a parameter on {p.device}; the step runs on {device}"
            if p.grad is not None and p.grad.is_sparse:
                return "sparse gradients change shape every step and cannot be captured"
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.device != p.device:
                    return (
                        f"{name} keeps state {key!r} on {value.device}: a captured step would "
                        f"update it once, at capture, and never on replay. Use an optimizer "
                        f"with capturable=True or fused=True (Adam, AdamW, SGD, ...)"
                    )
    return None


# --------------------------------------------------------------------------- the graph


class Backend(Protocol):
    """Records a step and replays it (`CudaGraphs`; tests substitute their own)."""

    executes_on_capture: bool  # True: capturing ran the step (no replay needed after capture)

    def capture(self, body: Any, inputs: list[Any], spec: Any) -> tuple[Any, torch.Tensor]: ...

    def replay(self, graph: Any) -> None: ...


class CudaGraphs:
    """Whole-step capture with ``torch.cuda.CUDAGraph``, one private memory pool per graph.

    ``torch.cuda.graph`` synchronises the device and empties the allocator's cache before it
    records (a one-off cost per capture). Separate pools keep graphs of different input shapes
    from reusing each other's gradient memory, at the price of one set of activations and
    gradients per cached graph.
    """

    executes_on_capture = False

    def __init__(self, stream: Any = None) -> None:
        # None: torch.cuda.graph's own side stream. Under DDP, the stream DDP was built on.
        self.stream = stream

    def capture(self, body: Any, inputs: list[Any], spec: Any) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            loss = body(*tree_unflatten(inputs, spec))
        return graph, loss

    def replay(self, graph: Any) -> None:
        graph.replay()


@dataclass
class StepGraph:
    """One captured step: its graph, static inputs, static loss and the gradients it writes."""

    graph: Any
    inputs: list[Any]  # static tensors (and the non-tensor leaves, as captured)
    loss: torch.Tensor
    grads: list[tuple[torch.Tensor, torch.Tensor]]  # (parameter, the gradient the graph writes)
    signature: tuple[Any, ...]
    replays: int = 0

    @classmethod
    def record(
        cls,
        backend: Backend,
        body: Any,
        batch: tuple[Any, ...],
        signature: tuple[Any, ...],
        params: list[torch.Tensor],
    ) -> StepGraph:
        """Capture `body` on static copies of `batch` (does not run the step on CUDA)."""
        leaves, spec = tree_flatten(batch)
        inputs = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves]
        graph, loss = backend.capture(body, inputs, spec)
        grads = [(p, p.grad) for p in params if p.grad is not None]
        return cls(graph, inputs, loss, grads, signature)

    def load(self, batch: tuple[Any, ...]) -> None:
        """Copy `batch` into the static inputs (asynchronous device copies)."""
        leaves, _ = tree_flatten(batch)
        for dst, src in zip(self.inputs, leaves, strict=True):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src, non_blocking=True)

    def replay(self, backend: Backend, restore_grads: bool) -> torch.Tensor:
        """Run the step once more; return a fresh copy of its loss (no sync)."""
        backend.replay(self.graph)
        self.replays += 1
        if restore_grads:  # an eager step in between pointed .grad elsewhere
            for p, g in self.grads:
                p.grad = g
        return self.loss.detach().clone()
