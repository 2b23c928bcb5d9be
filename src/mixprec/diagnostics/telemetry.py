"""What the loss scale is doing: gradient underflow at the current scale, and the scale's history.

`grad_underflow` answers "is my scale too low?": for each parameter, the fraction of gradient
elements that are zero, that fall in the low dtype's subnormal range (fewer bits of precision
left) or that would flush to zero in it (fp16 or bf16, the one the model trains in), at the
scale the gradients carry, and the same at a
2x scale, with whether 2x would overflow. `scale_history` answers "what did the scale do?": the
scale used by each of the scaler's last updates and which ones were skipped, as rows, a table and
a PNG.

Both read device values back, i.e. synchronise once per call: diagnostics, not the hot path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mixprec._optional import require_matplotlib
from mixprec.dtypes import dtype_name
from mixprec.errors import ArgumentTypeError, ArgumentValueError, MixprecError, UsageError

__all__ = ["ScaleHistory", "UnderflowReport", "grad_underflow", "scale_history"]


def _bounds(dtype: torch.dtype) -> tuple[float, float, float]:
    """(smallest subnormal, smallest normal, largest finite) of `dtype`."""
    info = torch.finfo(dtype)
    return float(info.smallest_normal) * float(info.eps), float(info.smallest_normal), info.max


def _dtype_in_use(model: torch.nn.Module) -> tuple[torch.dtype, str]:
    """The low dtype `model` trains in, and how that is known.

    In order: the opt level ``mixprec.initialize`` put on the model (its autocast region, or
    its cast weights), weights already in a 16-bit dtype, else the default of the device the
    gradients are on (fp16 on CUDA, bf16 on a CPU); a plain ``torch.autocast`` or
    ``mixprec.autocast`` loop leaves no trace on the model, so pass `dtype` there.
    """
    from mixprec.dtypes import LOW_DTYPES, default_dtype
    from mixprec.levels.model import amp_hooks

    hooks = amp_hooks(model)
    if hooks is not None:
        if hooks.region is not None and hooks.region[1] in LOW_DTYPES:
            return hooks.region[1], "the model's mixprec.initialize autocast region"
        if hooks.input_dtype in LOW_DTYPES:
            return hooks.input_dtype, "the model's weights, cast by mixprec.initialize"
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        if p.dtype in LOW_DTYPES:
            return p.dtype, "the model's weights"
    device = params[0].grad.device.type if params else "cpu"
    try:
        dtype = default_dtype(device).dtype
    except MixprecError:
        dtype = torch.float16
    return dtype, f"the {device.upper()} default; pass dtype= if the run used the other"


@dataclass(frozen=True)
class UnderflowReport:
    """Per-parameter gradient underflow at a scale and at twice that scale.

    Attributes:
        rows: one dict per parameter with a gradient: ``param``, ``numel``, ``zero`` (fraction
            exactly 0), ``flushed`` (fraction nonzero but below half the smallest subnormal:
            would be 0 in the low dtype), ``subnormal`` (fraction in the subnormal range),
            ``flushed_2x``/``subnormal_2x`` (the same at twice the scale), ``max_abs`` (largest
            magnitude at the scale) and ``overflow_2x`` (2x would exceed the dtype's maximum).
        dtype: the low dtype whose range was applied.
        scale: the factor applied to the stored gradients before measuring.
        dtype_reason: where `dtype` came from (given, or found on the model).
    """

    rows: list[dict[str, Any]]
    dtype: torch.dtype
    scale: float
    dtype_reason: str = "given"

    def total(self) -> dict[str, Any]:
        """Element-weighted totals over all parameters."""
        n = sum(r["numel"] for r in self.rows) or 1
        out: dict[str, Any] = {"numel": n}
        for key in ("zero", "flushed", "subnormal", "flushed_2x", "subnormal_2x"):
            out[key] = sum(r[key] * r["numel"] for r in self.rows) / n
        out["max_abs"] = max((r["max_abs"] for r in self.rows), default=0.0)
        out["overflow_2x"] = any(r["overflow_2x"] for r in self.rows)
        return out

    def advice(self, threshold: float = 0.01) -> list[str]:
        """Per module whose gradient elements flush to zero past `threshold` (a fraction), the
        fix in words: a higher loss scale where twice the scale overflows nowhere, else keeping
        the module in fp32 (`mixprec.heal.underflow`). No sync (reads the measured rows)."""
        from mixprec.heal.underflow import advise, by_module

        return [advise(g["module"], g["flushed"], self.scale, self.dtype,
                       overflow_at_2x=g["overflow_2x"], flushed_2x=g["flushed_2x"],
                       headroom=g["headroom"])
                for g in by_module(self) if g["flushed"] > threshold]  # fmt: skip

    def fix(self, policy: Any = None, threshold: float = 0.01) -> Any:
        """`policy` (default ``Policy()``) with the modules kept in fp32 that no higher scale
        can save (their gradients flush past `threshold` and twice the scale overflows)."""
        from mixprec.heal.underflow import fix

        return fix(self, policy, threshold)

    @property
    def saved_by_2x(self) -> float:
        """Fraction of all gradient elements a 2x scale lifts out of flush-to-zero or subnormals."""
        t = self.total()
        return (t["flushed"] - t["flushed_2x"]) + (t["subnormal"] - t["subnormal_2x"])

    def to_json(self, indent: int | None = 2) -> str:
        """Totals and rows as a JSON document."""
        return json.dumps({"dtype": str(self.dtype).removeprefix("torch."),
                           "dtype_reason": self.dtype_reason, "scale": self.scale,
                           "total": self.total(), "saved_by_2x": self.saved_by_2x,
                           "rows": self.rows}, indent=indent)  # fmt: skip

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __str__(self) -> str:
        t = self.total()
        verdict = (
            "a 2x scale would overflow (the scale is at its ceiling)" if t["overflow_2x"]
            else f"a 2x scale would lift {self.saved_by_2x:.2%} of elements and not overflow"
        )  # fmt: skip
        name = dtype_name(self.dtype)
        tiny, normal, _ = _bounds(self.dtype)
        lines = [
            f"gradient underflow in {name} ({self.dtype_reason}) at scale {self.scale:g}: zero "
            f"{t['zero']:.2%}, flushed {t['flushed']:.2%}, subnormal {t['subnormal']:.2%}; "
            f"largest |g| {t['max_abs']:.3g}; {verdict}",
        ]
        if self.dtype == torch.bfloat16:
            lines.append(
                f"  bf16 keeps fp32's exponent range, so bf16 runs need no loss scale: scale 1 "
                f"is the normal case, and only |g| below {tiny / 2:.2g} flushes to zero "
                f"(subnormal: below {normal:.2g})."
            )
        elif self.scale == 1:
            lines.append(
                f"  fp16 flushes |g| below {tiny / 2:.2g} (subnormal below {normal:.2g}). Scale 1 "
                "measures the gradients as stored: before scaler.unscale_() they carry the "
                "loss scale; after it, pass scale=scaler.get_scale()."
            )
        lines += [
            f"{'param':<40} {'numel':>10} {'zero':>7} {'flushed':>8} {'subnorm':>8} "
            f"{'at 2x':>15} {'max|g|':>9}",
        ]
        worst = sorted(self.rows, key=lambda r: -(r["flushed"] + r["subnormal"]))
        for r in worst[:20]:
            lines.append(
                f"{r['param'][:40]:<40} {r['numel']:>10} {r['zero']:>7.2%} {r['flushed']:>8.2%} "
                f"{r['subnormal']:>8.2%} {r['flushed_2x']:>7.2%}/{r['subnormal_2x']:<7.2%} "
                f"{r['max_abs']:>9.3g}" + ("  overflow at 2x" if r["overflow_2x"] else "")
            )
        if len(worst) > 20:
            lines.append(f"({len(worst) - 20} more parameters in report.rows)")
        lines += [f"advice: {a}" for a in self.advice()]
        return "\n".join(lines)


def grad_underflow(
    model: torch.nn.Module,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> UnderflowReport:
    """Measure how much of each parameter's gradient underflows `dtype` at `scale`.

    Call it after ``backward()``. With scaled gradients (before ``scaler.unscale_``) leave
    ``scale=1.0``; after unscaling pass the loss scale (``scaler.get_scale()``), so the figures
    describe the gradients as the low-precision backward saw them.

    `dtype` defaults to the one the model trains in: its ``mixprec.initialize`` opt level, or
    its 16-bit weights, else the default of the gradients' device (fp16 on CUDA, bf16 on a
    CPU); the report says which it used and why.

    Cost: a few reductions per parameter, then one host-device sync for all of them.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"grad_underflow needs a torch.nn.Module, got {type(model).__name__}.")
    if not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        raise ArgumentValueError(f"grad_underflow scale={scale!r} must be a finite number > 0.")
    reason = "given"
    if dtype is None:
        dtype, reason = _dtype_in_use(model)
    if dtype not in (torch.float16, torch.bfloat16):
        raise ArgumentValueError(
            f"grad_underflow dtype must be torch.float16 or torch.bfloat16, got {dtype}."
        )
    tiny, normal, top = _bounds(dtype)
    names, stats = [], []
    for name, p in model.named_parameters():
        g = p.grad
        if g is None or g.is_sparse:
            continue
        a = g.detach().abs().float() * scale
        n = max(a.numel(), 1)
        nz = a != 0
        row = torch.stack([
            (~nz).sum() / n,
            (nz & (a < tiny / 2)).sum() / n,
            ((a >= tiny / 2) & (a < normal)).sum() / n,
            (nz & (a < tiny / 4)).sum() / n,
            ((a >= tiny / 4) & (a < normal / 2)).sum() / n,
            a.max() if a.numel() else a.new_zeros(()),
        ])  # fmt: skip
        names.append((name, a.numel()))
        stats.append(row.to(stats[0].device) if stats else row)
    if not stats:
        raise UsageError(
            "grad_underflow found no gradients: call it after backward() (and before zero_grad)."
        )
    values = torch.stack(stats).tolist()  # the one sync
    rows = []
    for (name, numel), (zero, flushed, sub, flushed2, sub2, amax) in zip(
        names, values, strict=True
    ):
        rows.append({
            "param": name, "numel": numel, "zero": zero, "flushed": flushed, "subnormal": sub,
            "flushed_2x": flushed2, "subnormal_2x": sub2, "max_abs": amax,
            "overflow_2x": bool(amax * 2 > top),
        })  # fmt: skip
    return UnderflowReport(rows, dtype, float(scale), reason)


@dataclass(frozen=True)
class ScaleHistory:
    """The scale each of a GradScaler's last updates used, and which were skipped.

    Attributes:
        rows: ``{'update': i, 'scale': s, 'skipped': bool}`` per update, oldest first (the
            scaler keeps the last 1024).
        loss_id: which loss scale (``num_losses > 1``).
    """

    rows: list[dict[str, Any]]
    loss_id: int = 0

    @property
    def skipped(self) -> list[int]:
        """Indices of the skipped updates."""
        return [r["update"] for r in self.rows if r["skipped"]]

    def to_json(self, indent: int | None = 2) -> str:
        """The rows as JSON."""
        return json.dumps({"loss_id": self.loss_id, "rows": self.rows}, indent=indent)

    def __str__(self) -> str:
        if not self.rows:
            return "scale history: no updates yet"
        lines = [
            f"scale history (loss {self.loss_id}): {len(self.rows)} updates, "
            f"{len(self.skipped)} skipped",
            f"{'updates':>15} {'scale':>12}  skipped",
        ]
        # Runs of equal scale, one line each: the table stays short over long runs.
        start = 0
        for i in range(1, len(self.rows) + 1):
            if i == len(self.rows) or self.rows[i]["scale"] != self.rows[start]["scale"]:
                run = self.rows[start:i]
                span = (
                    f"{run[0]['update']}-{run[-1]['update']}"
                    if len(run) > 1
                    else str(run[0]["update"])
                )
                skips = sum(r["skipped"] for r in run)
                lines.append(f"{span:>15} {run[0]['scale']:>12g}  {skips or ''}")
                start = i
        return "\n".join(lines)

    def figure(self) -> Any:
        """The scale per update (log axis), skipped updates marked: a matplotlib Figure.

        Every update is a visible point, so a history of one update is a dot, not an empty
        line; the axes span at least one update either side and a factor of 2 above and below.
        """
        if not self.rows:
            raise UsageError(
                "scale history has no updates yet: nothing to plot. Call scale_history(scaler) "
                "after at least one scaler.update()."
            )
        from matplotlib.ticker import MaxNLocator

        plt = require_matplotlib()
        fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
        xs = [r["update"] for r in self.rows]
        ys = [r["scale"] for r in self.rows]
        # A dot per update on the step line: a line alone draws nothing for a single update.
        ax.plot(xs, ys, drawstyle="steps-post", marker="o", ms=3 if len(xs) > 50 else 5,
                label="loss scale")  # fmt: skip
        sk = [r for r in self.rows if r["skipped"]]
        if sk:
            ax.scatter([r["update"] for r in sk], [r["scale"] for r in sk], color="red",
                       marker="x", zorder=3, label=f"skipped ({len(sk)})")  # fmt: skip
        ax.set_yscale("log", base=2)
        ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
        ax.set_ylim(min(ys) / 2, max(ys) * 2)
        if max(xs) - min(xs) < 10:  # few updates: a tick on each, never between two
            ax.set_xticks(range(min(xs), max(xs) + 1))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("update")
        ax.set_ylabel("scale used")
        ax.set_title("mixprec.GradScaler: loss scale per update")
        ax.legend(loc="best")
        return fig

    def plot(self, path: str) -> str:
        """Write `figure` as a PNG at `path`; return the path."""
        plt = require_matplotlib()
        fig = self.figure()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def scale_history(scaler: Any, loss_id: int = 0) -> ScaleHistory:
    """The scaler's last updates (up to 1024) from its device-side history. One sync."""
    from mixprec.scaling.scaler import GradScaler

    if not isinstance(scaler, GradScaler):
        scaler = getattr(scaler, "scaler", scaler)  # TrainStep, AmpOptimizer
    if not isinstance(scaler, GradScaler):
        raise ArgumentTypeError(
            f"scale_history needs a mixprec.GradScaler (or a TrainStep/AmpOptimizer with one), "
            f"got {type(scaler).__name__}."
        )
    losses = scaler._losses
    if losses is None:
        return ScaleHistory([], loss_id)
    if not 0 <= loss_id < len(losses):
        raise ArgumentValueError(
            f"loss_id={loss_id} is out of range: this scaler has {len(losses)} loss scale(s), "
            f"so loss_id must be in 0..{len(losses) - 1}."
        )
    state = losses[loss_id].state
    size = state.history.numel()
    steps = int(state.steps.item())
    hist = state.history.tolist()
    rows = []
    for update in range(max(0, steps - size), steps):
        used = hist[update % size]
        if used != used:  # NaN: never written (loaded from a checkpoint without history)
            continue
        rows.append({"update": update, "scale": abs(used), "skipped": used < 0})
    return ScaleHistory(rows, loss_id)
