"""GradScaler checkpoints: every field out, everything validated before anything goes in.

The format is a flat dict of Python values. Its first five keys are torch.amp.GradScaler's
(``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``_growth_tracker``), so
either scaler loads the other's checkpoint; mixprec adds the hysteresis tracker, the bounds, the
counters, the scale history and, for several losses, a ``losses`` list. Writing reads device
tensors (a sync); loading writes them (no sync).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from mixprec.errors import MixprecError
from mixprec.scaling.state import HISTORY, ScaleConfig

if TYPE_CHECKING:
    from mixprec.scaling.scaler import GradScaler

__all__ = [
    "FORMAT",
    "ScalerCheckpointError",
    "describe",
    "load_state_dict",
    "loss_fields",
    "pending_entries",
    "state_dict",
    "validate",
]

FORMAT = "mixprec.GradScaler/1"

_CONFIG_KEYS = {
    "growth_factor": "growth_factor",
    "backoff_factor": "backoff_factor",
    "growth_interval": "growth_interval",
    "hysteresis": "hysteresis",
    "consecutive_hysteresis": "consecutive_hysteresis",
    "min_scale": "min_scale",
    "max_scale": "max_scale",
    "dynamic": "dynamic",
}
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class ScalerCheckpointError(MixprecError, ValueError):
    """A state dict the scaler refuses to load (the scaler is left unchanged)."""


def pending_entries(scaler: GradScaler) -> list[dict[str, Any]] | None:
    """Per loss, its fields as `_loss_entry` returns them (floats; NaN for unwritten history).

    None for a scaler that never ran and loaded nothing. Reads the device (a sync).
    """
    if scaler._losses is None:
        return None if scaler._pending_load is None else [dict(f) for f in scaler._pending_load]
    out = []
    for loss in scaler._losses:
        st = loss.state
        out.append({
            "scale": float(st.scale.item()),
            "growth_tracker": int(st.growth_tracker.item()),
            "hysteresis_tracker": int(st.hysteresis_tracker.item()),
            "steps": int(st.steps.item()),
            "skipped": int(st.skipped.item()),
            "last_skip": int(st.last_skip.item()),
            "history": [float(v) for v in st.history.tolist()],
        })  # fmt: skip
    return out


def loss_fields(scaler: GradScaler) -> list[dict[str, Any]]:
    """Per loss: every field as a plain Python value, history included (reads the device).

    Unwritten history slots are None (JSON has no NaN); a scaler that has not run yet reports
    its initial values, so its state dict has the same shape as any other.
    """
    cfg = scaler._config
    entries = pending_entries(scaler) or [
        {"scale": scaler._init_scale} for _ in range(scaler._num_losses)
    ]
    out = []
    for entry in entries:
        history = entry.get("history") or [math.nan] * HISTORY
        out.append({
            "scale": float(entry["scale"]),
            "growth_tracker": int(entry.get("growth_tracker", 0)),
            "hysteresis_tracker": int(entry.get("hysteresis_tracker", cfg.hysteresis)),
            "steps": int(entry.get("steps", 0)),
            "skipped": int(entry.get("skipped", 0)),
            "last_skip": int(entry.get("last_skip", -1)),
            "history": [None if math.isnan(v) else float(v) for v in history],
        })  # fmt: skip
    return out


def pending_scale(pending: list[dict[str, Any]] | None, init_scale: float) -> float:
    """The scale of loss 0 before the scaler's state exists on a device."""
    if pending and "scale" in pending[0]:
        return float(pending[0]["scale"])
    return init_scale


def state_dict(scaler: GradScaler) -> dict[str, Any]:
    """See :meth:`GradScaler.state_dict`."""
    if not scaler._enabled:
        return {}
    cfg = scaler._config
    losses = loss_fields(scaler)
    first = losses[0]
    out: dict[str, Any] = {
        "scale": float(first["scale"]),
        "growth_factor": cfg.growth_factor,
        "backoff_factor": cfg.backoff_factor,
        "growth_interval": cfg.growth_interval,
        "_growth_tracker": first["growth_tracker"],
        "format": FORMAT,
        "hysteresis": cfg.hysteresis,
        "consecutive_hysteresis": cfg.consecutive_hysteresis,
        "min_scale": cfg.min_scale,
        "max_scale": cfg.max_scale,
        "dynamic": cfg.dynamic,
        "_hysteresis_tracker": first["hysteresis_tracker"],
        "steps": first["steps"],
        "skipped": first["skipped"],
        "last_skip": first["last_skip"],
        "history": first["history"],
    }
    if scaler._num_losses > 1:
        out["losses"] = losses
    return out


def _number(sd: dict[str, Any], key: str, kind: type, rule: str, ok) -> Any:
    value = sd[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScalerCheckpointError(
            f"state_dict[{key!r}] = {value!r} ({type(value).__name__}) is not a number."
        )
    value = kind(value)
    if not ok(value):
        raise ScalerCheckpointError(f"state_dict[{key!r}] = {value!r} is invalid: {rule}.")
    return value


def _loss_entry(sd: dict[str, Any], cfg: ScaleConfig, where: str) -> dict[str, Any]:
    missing = [k for k in ("scale",) if k not in sd]
    if missing:
        raise ScalerCheckpointError(f"{where} lacks the key 'scale'.")
    fields: dict[str, Any] = {
        "scale": _number(sd, "scale", float, "the scale must be finite and > 0",
                         lambda v: 0 < v < math.inf),
    }  # fmt: skip
    for src, dst, default, rule, ok in (
        ("_growth_tracker", "growth_tracker", 0, "must be in [0, growth_interval)",
         lambda v: 0 <= v < cfg.growth_interval),
        ("growth_tracker", "growth_tracker", 0, "must be in [0, growth_interval)",
         lambda v: 0 <= v < cfg.growth_interval),
        ("_hysteresis_tracker", "hysteresis_tracker", cfg.hysteresis, "must be <= hysteresis",
         lambda v: v <= cfg.hysteresis),
        ("hysteresis_tracker", "hysteresis_tracker", cfg.hysteresis, "must be <= hysteresis",
         lambda v: v <= cfg.hysteresis),
        ("steps", "steps", 0, "must be >= 0", lambda v: v >= 0),
        ("skipped", "skipped", 0, "must be >= 0", lambda v: v >= 0),
        ("last_skip", "last_skip", -1, "must be >= -1", lambda v: v >= -1),
    ):  # fmt: skip
        if src in sd:
            fields[dst] = _number(sd, src, int, rule, ok)
        else:
            fields.setdefault(dst, default)
    if fields["skipped"] > fields["steps"]:
        raise ScalerCheckpointError(f"{where}: skipped > steps; the counters are inconsistent.")
    history = sd.get("history")
    if isinstance(history, (list, tuple)) and not history:
        history = None  # written by mixprec 0.6 before first use: nothing recorded yet
    if history is not None:
        if not (isinstance(history, (list, tuple)) and len(history) == HISTORY):
            size = len(history) if hasattr(history, "__len__") else "?"
            raise ScalerCheckpointError(
                f"{where}['history'] must be a list of {HISTORY} floats (None for unwritten "
                f"slots), got {type(history).__name__} of length {size}."
            )
        try:
            fields["history"] = [math.nan if v is None else float(v) for v in history]
        except (TypeError, ValueError) as err:
            raise ScalerCheckpointError(f"{where}['history'] holds a non-number: {err}") from err
    return fields


def _wrong_kind(sd: dict[str, Any]) -> str | None:
    """What `sd` is, when it is some other object's state dict (the usual mix-up)."""
    fmt = sd.get("format")
    if fmt in ("mixprec.AmpOptimizer/1", "mixprec.AmpOptimizer/2"):
        return ("this is an AmpOptimizer's state dict (mixprec.initialize's optimizer), which "
                "holds the scaler under 'scaler': load it with optimizer.load_state_dict(...), "
                "or pass state_dict['scaler'] here")  # fmt: skip
    if fmt == "mixprec.TrainStep/1":
        return ("this is a TrainStep's state dict: load it with step.load_state_dict(...), "
                "which restores the scaler too")  # fmt: skip
    if "state" in sd and "param_groups" in sd:
        return (
            "this is an optimizer's state dict (keys 'state' and 'param_groups'): load it "
            "with optimizer.load_state_dict(...) and pass scaler.state_dict()'s output here"
        )
    for key in ("scaler", "grad_scaler", "scaler_state", "amp"):
        if isinstance(sd.get(key), dict) and "scale" in sd[key]:
            return (f"this looks like a whole training checkpoint; the scaler's state is under "
                    f"{key!r}: pass state_dict[{key!r}]")  # fmt: skip
    return None


def _from_apex(sd: dict[str, Any], scaler: GradScaler) -> dict[str, Any]:
    """Apex's ``amp.state_dict()`` (``{'loss_scaler0': {'loss_scale', 'unskipped'}, ...}``) in
    this format, with this scaler's config; any other dict unchanged. Apex's ``unskipped`` is
    the growth tracker (clean updates since the last growth or overflow)."""
    keys = [f"loss_scaler{i}" for i in range(len(sd))]
    if not sd or sorted(sd) != sorted(keys):
        apex = [k for k in sd if isinstance(k, str) and k.startswith("loss_scaler")]
        if apex and "scale" not in sd:  # Apex's format, with keys it never wrote
            unexpected = sorted(str(k) for k in sd if k not in keys)
            raise ScalerCheckpointError(
                f"an Apex amp state dict has the keys loss_scaler0, loss_scaler1, ... (one per "
                f"loss, numbered from 0) and nothing else; unexpected key(s): {unexpected}. "
                f"Pass amp.state_dict() as Apex saved it."
            )
        return sd
    losses = []
    for key in keys:
        entry = sd[key]
        if not isinstance(entry, dict) or not {"loss_scale", "unskipped"} <= set(entry):
            raise ScalerCheckpointError(
                f"state_dict[{key!r}] is not an Apex loss scaler's entry: it needs the keys "
                f"'loss_scale' and 'unskipped'."
            )
        losses.append({"scale": entry["loss_scale"], "_growth_tracker": entry["unskipped"]})
    cfg = scaler._config
    out: dict[str, Any] = {
        **losses[0], "growth_factor": cfg.growth_factor, "backoff_factor": cfg.backoff_factor,
        "growth_interval": cfg.growth_interval,
    }  # fmt: skip
    if len(losses) > 1:
        out["losses"] = losses
    return out


def validate(
    scaler: GradScaler, sd: Any, *, in_iteration_ok: bool = False
) -> tuple[ScaleConfig, list[dict[str, Any]]]:
    """Check `sd` against `scaler` and return what loading it would set. Changes nothing.

    Args:
        in_iteration_ok: skip the between-iterations check (a caller that finishes the
            iteration itself before loading: ``AmpOptimizer``'s deferred update).

    Raises:
        ScalerCheckpointError: naming the first problem.
    """
    if not isinstance(sd, dict):
        raise ScalerCheckpointError(
            f"GradScaler.load_state_dict expects a dict (from scaler.state_dict() or "
            f"torch.amp.GradScaler's), got {type(sd).__name__}."
        )
    if not sd:
        raise ScalerCheckpointError(
            "the state dict is empty: it was probably saved from a disabled GradScaler. Load it "
            "into a disabled scaler, or drop it."
        )
    sd = _from_apex(sd, scaler)
    kind = _wrong_kind(sd)
    if kind is not None:
        raise ScalerCheckpointError(f"not a GradScaler state dict: {kind}.")
    missing = [k for k in _TORCH_KEYS if k not in sd]
    if missing:
        raise ScalerCheckpointError(
            f"the state dict lacks {missing}; a GradScaler state dict (torch.amp's or mixprec's) "
            f"has at least the keys {list(_TORCH_KEYS)}."
        )
    fmt = sd.get("format")
    if fmt is not None and fmt != FORMAT:
        raise ScalerCheckpointError(
            f"state dict format {fmt!r} is not one this version reads ({FORMAT!r})."
        )
    try:
        cfg = ScaleConfig(**{
            dst: sd.get(src, getattr(scaler._config, dst)) for src, dst in _CONFIG_KEYS.items()
        })  # fmt: skip
    except MixprecError as err:
        raise ScalerCheckpointError(f"the state dict's scaling config is invalid: {err}") from err
    losses_sd = sd.get("losses")
    if losses_sd is None:
        entries = [_loss_entry(sd, cfg, "state_dict")]
    else:
        if not isinstance(losses_sd, list) or not all(isinstance(e, dict) for e in losses_sd):
            raise ScalerCheckpointError("state_dict['losses'] must be a list of dicts.")
        entries = [_loss_entry(e, cfg, f"state_dict['losses'][{i}]")
                   for i, e in enumerate(losses_sd)]  # fmt: skip
    if len(entries) != scaler._num_losses:
        raise ScalerCheckpointError(
            f"the state dict holds {len(entries)} loss scale(s) but this scaler has num_losses="
            f"{scaler._num_losses}; create the scaler with num_losses={len(entries)}."
        )
    if scaler._per_optimizer and not in_iteration_ok:
        raise ScalerCheckpointError(
            "load_state_dict was called in the middle of an iteration; load between iterations "
            "(before the first unscale_/step of an iteration, or after update())."
        )
    return cfg, entries


def load_state_dict(scaler: GradScaler, sd: dict[str, Any]) -> None:
    """See :meth:`GradScaler.load_state_dict`. Validates everything, then commits."""
    if not scaler._enabled:
        return
    cfg, entries = validate(scaler, sd)
    # Everything checked: commit.
    scaler._config = cfg
    scaler._init_scale = entries[0]["scale"]
    # Host counters continue from the checkpoint: on_skip must not report its history again.
    scaler._reported_steps = scaler._host_updates = entries[0]["steps"]
    scaler._unchecked = 0
    if scaler._losses is None:
        scaler._pending_load = entries
        return
    for loss, fields in zip(scaler._losses, entries, strict=True):
        st = loss.state
        st.scale.fill_(fields["scale"])
        st.growth_tracker.fill_(fields["growth_tracker"])
        st.hysteresis_tracker.fill_(fields["hysteresis_tracker"])
        st.steps.fill_(fields["steps"])
        st.skipped.fill_(fields["skipped"])
        st.last_skip.fill_(fields["last_skip"])
        if "history" in fields:
            st.history.copy_(st.history.new_tensor(fields["history"]))
        else:
            st.history.fill_(math.nan)
        loss.replicas.clear()


def describe(scaler: GradScaler) -> dict[str, Any]:
    """See :meth:`GradScaler.stats`."""
    losses = loss_fields(scaler)
    for entry in losses:
        entry.pop("history", None)
    return {
        "enabled": scaler._enabled,
        "config": scaler._config,
        "losses": losses,
    }
