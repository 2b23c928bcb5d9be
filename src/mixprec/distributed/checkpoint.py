"""Sharded checkpoints of model, optimizer (masters included) and scaler, through torch's DCP.

    mixprec.save_checkpoint("ckpt/step-1000", model, optimizer)     # every rank calls it
    mixprec.load_checkpoint("ckpt/step-1000", model, optimizer)     # any world size, any layout

Storage, resharding and the collective save/load protocol are ``torch.distributed.checkpoint``'s
(DCP): each rank writes its own shards, and a checkpoint saved on N ranks loads on M ranks. What
mixprec adds is a state dict whose keys do not depend on how the model is wrapped or sharded:

- ``model``: every parameter and persistent buffer by its fully qualified name, the DDP and
  ``torch.compile`` prefixes removed. A parameter's entry holds its **fp32 values**: the master
  weight in unsharded O2 (whose low-precision copy is refreshed from it on load), FSDP's fp32
  shard under `mixprec.fully_shard` (those shards are the masters). So an O2 checkpoint moves
  between DDP, a single process and FSDP2 in either direction.
- ``optimizer``: the optimizer state by parameter name (the tensors DCP shards), and the param
  groups' hyperparameters (JSON; a learning rate held as a device tensor is saved as a float and
  loaded into the same tensor, so a captured TrainStep keeps it). How the loading job runs its
  optimizer (``foreach``, ``fused``, ``capturable``, ``differentiable``) stays its own.
- ``scaler``: every field of the `GradScaler` (JSON), and ``meta``: the format and opt level.

Loading is all-or-nothing: the checkpoint's metadata is checked first (format, opt level,
loss-scale setting, FP8 layout), DCP reads into new tensors (one extra copy of the model and
optimizer state in memory while it runs), the parameter names are checked, and only then is
anything copied in. A load that fails changes nothing, an optimizer state created
only to give DCP something to fill included.

Bit-for-bit continuation: loading restores every value the step reads (weights, masters,
optimizer state, scale and trackers), so a run resumed with the same data order and world size
continues exactly as the uninterrupted run. Across world sizes the gradient reduction sums the
ranks' contributions in another grouping; see docs/distributed.md for where that is still exact.
Not saved: RNG states, data-loader position, LR schedulers: save them beside the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.distributed.fp8 import plain_dtensor
from mixprec.distributed.topology import DistributedError, is_initialized, unwrap_ddp
from mixprec.distributed.wrapping import refuse_lowmem_on_shards
from mixprec.scaling.scaler import GradScaler

__all__ = ["FORMAT", "load_checkpoint", "save_checkpoint", "state_dict"]

FORMAT = "mixprec.checkpoint/1"
_KEY = "mixprec"  # the top-level key in DCP's state dict (other entries may sit beside it)


def _unwrap(model: nn.Module) -> nn.Module:
    model = unwrap_ddp(model)
    return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule


def _parts(optimizer: Any, scaler: GradScaler | None) -> tuple[Any, GradScaler | None, Any]:
    """(the torch optimizer that steps, the scaler, the AmpOptimizer or None)."""
    from mixprec.levels.optimizer import AmpOptimizer

    if isinstance(optimizer, AmpOptimizer):
        optimizer._scaling.flush()  # the deferred scale update belongs to the saved step
        return optimizer.optimizer, scaler if scaler is not None else optimizer.scaler, optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DistributedError(
            f"expected a torch.optim.Optimizer or the AmpOptimizer mixprec.initialize returned, "
            f"got {type(optimizer).__name__}."
        )
    return optimizer, scaler, None


def _names(model: nn.Module, amp: Any) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """The model entries (fp32 masters for O2 weights) and the name of each stepped tensor."""
    module = _unwrap(model)
    pairs = [] if amp is None else zip(amp._low, amp._masters, strict=True)
    master_of = {id(low): master for low, master in pairs}
    entries: dict[str, torch.Tensor] = {}
    name_of: dict[int, str] = {}
    for name, p in module.named_parameters():
        stepped = master_of.get(id(p), p)
        name_of[id(stepped)] = name
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            value = master_of.get(id(value), value)
            # A weight FSDP2 gathers in FP8 is saved as the plain shard it wraps.
            entries[name] = plain_dtensor(value.detach())
    return entries, name_of


def state_dict(
    model: nn.Module, optimizer: Any, scaler: GradScaler | None = None
) -> dict[str, Any]:
    """The DCP-ready state dict of a mixprec training job (live tensors, no copies).

    For composing with other entries in your own ``dcp.save({...})`` call. Reading the scaler
    synchronises with the device.
    """
    inner, scaler, amp = _parts(optimizer, scaler)
    # The last line of defence: initialize and TrainStep refuse this combination already.
    refuse_lowmem_on_shards(inner, "mixprec checkpoints (save_checkpoint, load_checkpoint)")
    entries, name_of = _names(model, amp)
    stepped = [p for g in inner.param_groups for p in g["params"]]
    missing = [i for i, p in enumerate(stepped) if id(p) not in name_of]
    if missing:
        raise DistributedError(
            f"the optimizer steps {len(missing)} tensor(s) that are not parameters of this model "
            f"(the first is parameter {missing[0]} of its param groups); checkpoints name "
            f"optimizer state by parameter name, so pass the model whose parameters it steps."
        )
    osd = inner.state_dict()
    state = {name_of[id(stepped[i])]: dict(st) for i, st in osd["state"].items()}
    groups = []
    for group in osd["param_groups"]:
        hyper = {k: _plain(v) for k, v in group.items() if k != "params"}
        hyper["params"] = [name_of[id(stepped[i])] for i in group["params"]]
        groups.append(hyper)
    level = amp.options.level.value if amp is not None else None
    return {
        "model": entries,
        "optimizer": {"state": state, "param_groups": json.dumps(groups)},
        "scaler": json.dumps(scaler.state_dict() if scaler is not None else {}),
        "meta": json.dumps({"format": FORMAT, "opt_level": level}),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()  # a device lr: saved as a float (one sync, at checkpoint time)
    if isinstance(value, tuple):
        return list(value)
    return value


def save_checkpoint(
    checkpoint_id: str, model: nn.Module, optimizer: Any, scaler: GradScaler | None = None,
    **dcp_kwargs: Any,
) -> None:  # fmt: skip
    """Save model, optimizer (masters included) and scaler with ``torch.distributed.checkpoint``.

    Call it on every rank (it is collective when a process group exists; it also runs in a
    single process without one). `dcp_kwargs` go to ``dcp.save`` (``process_group``,
    ``storage_writer``, ...). Synchronises with the device (it reads the scale).
    """
    import torch.distributed.checkpoint as dcp

    with _single_process(dcp_kwargs):
        dcp.save({_KEY: state_dict(model, optimizer, scaler)}, checkpoint_id=checkpoint_id,
                 **dcp_kwargs)  # fmt: skip


def load_checkpoint(
    checkpoint_id: str, model: nn.Module, optimizer: Any, scaler: GradScaler | None = None,
    **dcp_kwargs: Any,
) -> None:  # fmt: skip
    """Load what `save_checkpoint` wrote, resharding to this job's layout; all-or-nothing.

    Call it on every rank. The checkpoint's metadata (format, opt level, loss-scale setting,
    FP8 layout) is read and checked first, in one small collective read, then the tensors.
    A parameter that had no optimizer state when the checkpoint was saved (a step-0
    checkpoint, a head that never got a gradient) has none after loading, as with torch's
    ``Optimizer.load_state_dict``. Cost: one extra copy of the model and optimizer state (this
    rank's shards) while DCP reads.

    The loss-scale setting must be this job's: the same mode (dynamic or static), for a static
    scale the same value, and for a dynamic one the same rule (growth_factor, backoff_factor,
    growth_interval, hysteresis, consecutive_hysteresis, min_scale, max_scale). The scale, its
    trackers and counters are state, and are loaded.

    Raises:
        DistributedError: the checkpoint does not fit (another opt level, other parameter
            names, a loss-scale setting that differs) or cannot be read; nothing was changed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    inner, scaler, amp = _parts(optimizer, scaler)
    live = state_dict(model, optimizer, scaler)
    saved, header = _read_header(checkpoint_id, dcp_kwargs)
    loaded_scaler = _check_header(live, header, scaler)
    fp8 = _fp8_mismatch(saved, live["model"])
    if fp8 is not None:
        raise DistributedError(
            f"the checkpoint at {checkpoint_id!r} does not fit this model (nothing was "
            f"changed): {fp8}"
        )
    # Optimizer state is asked for only where the checkpoint has some: a parameter that had
    # none when it was saved (a step-0 checkpoint, a head that never got a gradient) has none
    # after loading, as with torch's Optimizer.load_state_dict.
    with_state = _saved_state_names(saved, live)
    _, name_of = _names(model, amp)
    created = _materialize(inner, [
        p for g in inner.param_groups for p in g["params"]
        if name_of.get(id(p)) in with_state and not inner.state.get(p)
    ])  # fmt: skip
    try:
        live = state_dict(model, optimizer, scaler)
        live["optimizer"]["state"] = {
            name: st for name, st in live["optimizer"]["state"].items() if name in with_state
        }
        target = _map(live, _fresh)
        try:
            with _single_process(dcp_kwargs):
                dcp.load({_KEY: target}, checkpoint_id=checkpoint_id, **dcp_kwargs)
        except (Exception, CheckpointException) as err:  # planned (names, shapes) before reading
            raise DistributedError(
                f"the checkpoint at {checkpoint_id!r} does not fit this model and optimizer "
                f"(nothing was changed): {_cause(err)}"
            ) from err
        _check_groups(live, target)
    except BaseException:
        for p in created:
            inner.state.pop(p, None)  # created only to give DCP tensors to fill
        raise
    _commit(live, target, inner, scaler, loaded_scaler, amp)
    for module in _unwrap(model).modules():
        loaded = getattr(module, "fp8_loaded", None)  # an FP8 layer: its caches are stale now
        if callable(loaded):
            loaded()


def _read_header(checkpoint_id: Any, dcp_kwargs: dict[str, Any]) -> tuple[dict, dict]:
    """(DCP's metadata of every saved entry by flattened key, the saved JSON entries).

    One small collective ``dcp.load`` of the JSON entries only, so that the opt level, the
    scaler setting and the FP8 layout are checked before any tensor is read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    header: dict[str, Any] = {"meta": None, "scaler": None}
    kwargs = {k: v for k, v in dcp_kwargs.items() if k != "planner"}  # the user's: for tensors
    planner = DefaultLoadPlanner(allow_partial_load=True)  # a foreign checkpoint: said below
    try:
        with _single_process(kwargs):
            dcp.load({_KEY: header}, checkpoint_id=checkpoint_id, planner=planner, **kwargs)
    except (Exception, CheckpointException) as err:
        raise DistributedError(
            f"the checkpoint at {checkpoint_id!r} could not be read (nothing was changed): "
            f"{_cause(err)}. Pass the directory save_checkpoint wrote (or its storage_reader=)."
        ) from err
    saved = dict(planner.metadata.state_dict_metadata)
    if not all(isinstance(v, str) for v in (header["meta"], header["scaler"])):
        raise DistributedError(
            f"the checkpoint at {checkpoint_id!r} is not one mixprec.save_checkpoint wrote (it "
            f"has no {_KEY}.meta entry); nothing was changed. Load it with "
            f"torch.distributed.checkpoint.load into the state dict it was saved from."
        )
    return saved, header


def _fp8_mismatch(saved: dict[str, Any], model: dict[str, Any]) -> str | None:
    """Why the FP8 layer state in a checkpoint (`saved`: its metadata by key) does not fit
    `model`'s entries, or None. DCP loads only what the model asks for, so FP8 histories and
    scales saved from an FP8 model would be dropped silently by a model without them; and
    another recipe's history length only shows as a size mismatch."""
    head = f"{_KEY}.model."
    fp8 = {k[len(head):]: v for k, v in saved.items()
           if k.startswith(head) and k.rsplit(".", 1)[-1].startswith("fp8_")}  # fmt: skip
    absent = sorted(k for k in fp8 if k not in model)
    if absent:
        return (
            f"it holds FP8 layer state ({len(absent)} tensors, the first {absent[0]!r}) that "
            f"this model has no place for: it was saved from a model initialized with fp8=..., "
            f"and loading it here would drop the amax histories and scales. Initialize this "
            f"model with the same fp8= recipe."
        )
    for name, meta in fp8.items():
        mine = model.get(name)
        size = getattr(meta, "size", None)
        history = name.endswith("fp8_history") and isinstance(mine, torch.Tensor)
        if history and size is not None and tuple(size) != tuple(mine.shape):
            return (
                f"its FP8 layer {name.rsplit('.', 1)[0]!r} keeps an amax history of "
                f"{tuple(size)[-1]} step(s) and this model's keeps {mine.shape[-1]}: it was "
                f"saved with another FP8 recipe (or history length). Initialize this model "
                f"with the checkpoint's fp8= recipe."
            )
    return None


def _cause(err: BaseException) -> str:
    """The first rank's own error inside DCP's CheckpointException (which lists every rank's)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (exc, _) = next(iter(sorted(failures.items())))
        return f"{type(exc).__name__} on rank {rank}: {exc}"
    return f"{type(err).__name__}: {err}"


@contextlib.contextmanager
def _single_process(dcp_kwargs: dict[str, Any]) -> Iterator[None]:
    """Without a process group, run DCP in one process, and drop its warning that it does."""
    with warnings.catch_warnings():
        if not is_initialized():
            dcp_kwargs.setdefault("no_dist", True)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _map(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return tree


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)  # a DTensor for a DTensor: DCP reads this rank's shard into it


def _saved_state_names(saved: dict[str, Any], live: dict[str, Any]) -> set[str]:
    """The names of this optimizer's parameters that have optimizer state in the checkpoint
    (`saved`: its metadata by flattened key, ``mixprec.optimizer.state.<name>.<state key>``)."""
    head = f"{_KEY}.optimizer.state."
    prefixes = set()
    for key in saved:
        if key.startswith(head):
            parts = key[len(head) :].split(".")
            prefixes.update(".".join(parts[:i]) for i in range(1, len(parts)))
    names = [n for g in json.loads(live["optimizer"]["param_groups"]) for n in g["params"]]
    return {n for n in names if n in prefixes}


def _materialize(inner: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Create the optimizer state of `params` (a step with zero gradients for them, none for
    the others, and lr 0) so DCP has targets; the other parameters' state is not touched.

    Returns the parameters whose state it created. Gradients and learning rates are put back
    as they were.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return []
    everything = [p for g in inner.param_groups for p in g["params"]]
    grads = [p.grad for p in everything]
    lrs = [g.get("lr") for g in inner.param_groups]
    try:
        for p in everything:
            p.grad = None  # skipped by the step: its state stays as it is
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in inner.param_groups:
            if isinstance(g.get("lr"), torch.Tensor):
                g["lr"] = torch.zeros_like(g["lr"])
            elif "lr" in g:
                g["lr"] = 0.0
        inner.step()
    finally:
        for p, grad in zip(everything, grads, strict=True):
            p.grad = grad
        for g, lr in zip(inner.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
    return [p for p in params if inner.state.get(p)]


def _check_header(
    live: dict[str, Any], header: dict[str, Any], scaler: GradScaler | None
) -> dict[str, Any]:
    """Check the checkpoint's format, opt level and scaler setting against this job's (before
    any tensor is read); return the scaler fields to load."""
    meta, mine = json.loads(header["meta"]), json.loads(live["meta"])
    if meta.get("format") != FORMAT:
        raise DistributedError(
            f"not a mixprec checkpoint (format {meta.get('format')!r}, expected {FORMAT!r}); "
            f"nothing was changed."
        )
    if meta.get("opt_level") != mine.get("opt_level"):
        raise DistributedError(
            f"the checkpoint was saved at opt level {meta.get('opt_level')!r}, this job runs "
            f"{mine.get('opt_level')!r}: initialize (or mixprec.fully_shard) with the same level. "
            f"Nothing was changed."
        )
    fields = json.loads(header["scaler"])
    if bool(fields) != (scaler is not None and scaler.is_enabled()):
        raise DistributedError(
            "the checkpoint's loss-scaling setting differs from this job's (one has an enabled "
            "scaler, the other not); use the same opt level and loss_scale. Nothing was changed."
        )
    if fields:
        assert scaler is not None
        GradScaler(scaler._device, enabled=True).load_state_dict(fields)  # validates only
        differs = _scaler_mismatch(fields, json.loads(live["scaler"]))
        if differs is not None:
            raise DistributedError(f"{differs} Nothing was changed.")
    return fields


# The rule a dynamic scale moves by: the job's configuration, which a checkpoint must match
# (loading another would silently change the job's; not loading it would break the resumed
# run's bit-for-bit continuation). The scale itself and its trackers are state, loaded.
_SCALE_RULE = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis",
               "consecutive_hysteresis", "min_scale", "max_scale")  # fmt: skip


def _scaler_mismatch(theirs: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """How the checkpoint's loss-scale setting differs from this job's, with the fix; or None."""

    def setting(fields: dict[str, Any]) -> str:
        if fields.get("dynamic", True):
            return "dynamic (loss_scale='dynamic')"
        return f"static (loss_scale={float(fields['scale'])!r})"

    dynamic = theirs.get("dynamic", True), ours.get("dynamic", True)
    if dynamic[0] != dynamic[1] or (
        not dynamic[0] and float(theirs["scale"]) != float(ours["scale"])
    ):
        return (
            f"the checkpoint's loss scale is {setting(theirs)} and this job's is "
            f"{setting(ours)}: initialize this job with the checkpoint's setting (or pass a "
            f"mixprec.GradScaler with it as scaler=), or load a checkpoint saved with this "
            f"job's."
        )
    if not dynamic[0]:
        return None  # a static scale never moves: its growth rule is never used
    rule = [k for k in _SCALE_RULE if k in theirs and theirs[k] != ours.get(k)]
    if not rule:
        return None
    listed = ", ".join(f"{k}={theirs[k]!r} (this job: {ours.get(k)!r})" for k in rule)
    return (
        f"the checkpoint's dynamic loss scale moves by another rule than this job's: {listed}. "
        f"Create this job's scaler with the checkpoint's settings (initialize's "
        f"min_loss_scale/max_loss_scale, or a mixprec.GradScaler passed as scaler=), and change "
        f"them after loading if you mean to (scaler.set_growth_interval(), ...)."
    )


def _check_groups(live: dict[str, Any], loaded: dict[str, Any]) -> None:
    theirs, ours = (
        json.loads(loaded["optimizer"]["param_groups"]),
        json.loads(live["optimizer"]["param_groups"]),
    )
    if [g["params"] for g in theirs] != [g["params"] for g in ours]:
        raise DistributedError(
            "the checkpoint's optimizer param groups name other parameters than this "
            "optimizer's (build the optimizer over the same parameters, in the same groups); "
            "nothing was changed."
        )


def _commit(live, loaded, inner, scaler, scaler_fields, amp) -> None:
    with torch.no_grad():
        for name, dst in live["model"].items():
            dst.copy_(loaded["model"][name])
        if amp is not None and amp._low:
            torch._foreach_copy_(amp._low, amp._masters)  # low-precision weights from masters
    order = [n for g in json.loads(live["optimizer"]["param_groups"]) for n in g["params"]]
    index = {name: i for i, name in enumerate(order)}  # torch's format: state by position
    groups = []
    for current, saved in zip(inner.param_groups, json.loads(loaded["optimizer"]["param_groups"]),
                              strict=True):  # fmt: skip
        group = {k: _into(k, current.get(k), v) for k, v in saved.items() if k != "params"}
        group["params"] = [index[name] for name in saved["params"]]
        groups.append(group)
    state = {index[name]: st for name, st in loaded["optimizer"]["state"].items()}
    inner.load_state_dict({"state": state, "param_groups": groups})
    if scaler is not None and scaler_fields:
        scaler.load_state_dict(scaler_fields)
    if amp is not None:
        amp._scaling.pending = False


# How this job runs its optimizer (not what it learned): kept from the live optimizer.
_RUNTIME_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _into(key: str, current: Any, saved: Any) -> Any:
    if key in _RUNTIME_FLAGS:
        return current
    # A device tensor (an lr TrainStep moved to the GPU) keeps its identity: fill it.
    if isinstance(current, torch.Tensor):
        current.fill_(saved)
        return current
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved
