"""`fp8_report`: per FP8 layer, the scales in use, the amaxes behind them and the FP8 error.

What the numbers mean, per operand (input, weight, output gradient):

- *scale*: the factor the operand was last multiplied by before its cast (``fmax / amax`` for a
  dynamic recipe; the rowwise figure is the smallest row scale);
- *delayed*: the scale the amax history gives for the next step (``inf``: no history yet);
- *amax*: the operand's largest magnitude in the last step, and the largest in the window;
- *error*: ``|y_fp8 - y_fp32| / |y_fp32|`` of the last forward output, measured only while
  ``measure_error`` is on (`mixprec.explain` and ``watch_nonfinite(fp8_error=True)`` do that);
- *formats*: the FP8 formats of the operands (inputs and weights e4m3; gradients the recipe's);
- *gemm*: which path the layer's products took on its last batch (`mixprec.fp8.gemm`:
  ``scaled_mm`` or ``emulate``, measured per machine), ``not run`` before its first forward;
- *quantize*: how its operands are quantised (`mixprec.fp8.fused`): ``compiled`` (two kernels
  per operand, CUDA) or ``eager`` (separate elementwise kernels).

The relative error of an e4m3 product is about 2-4% for well-scaled operands (each e4m3 value
carries a relative rounding error of up to 2**-4); a layer that stays above `LARGE_ERROR` is a
candidate to keep in bf16 with ``policy.fp8('!<layer>')``, which the report suggests.

Cost: one host-device sync (all layers' figures are stacked and read at once).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from mixprec.fp8 import fused, gemm
from mixprec.fp8.convert import fp8_layers
from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipe import Fp8Recipe, format_name

__all__ = ["LARGE_ERROR", "Fp8LayerStats", "Fp8Report", "fp8_report"]

#: Relative output error above which the report suggests keeping a layer out of FP8.
LARGE_ERROR = 0.1


@dataclass(frozen=True)
class Fp8LayerStats:
    """One FP8 layer's figures (operands in the order input, weight, grad)."""

    module: str
    recipe: str
    reason: str
    scale: tuple[float, float, float]
    delayed_scale: tuple[float, float, float]
    amax: tuple[float, float, float]
    window_amax: tuple[float, float, float]
    error: float | None
    formats: str = "e4m3 x e4m3, grad e5m2"
    gemm: str = "not run"
    quantize: str = "eager"

    @property
    def large_error(self) -> bool:
        """Whether the measured error is above `LARGE_ERROR`."""
        return self.error is not None and self.error > LARGE_ERROR


class Fp8Report:
    """Every FP8 layer of a model (``str()``: a table; ``rows``: dicts; ``to_json()``)."""

    def __init__(self, layers: list[Fp8LayerStats]) -> None:
        self.layers = layers

    @property
    def rows(self) -> list[dict]:
        """One dict per layer (``asdict`` of `Fp8LayerStats`)."""
        return [asdict(s) for s in self.layers]

    def __iter__(self) -> Iterator[Fp8LayerStats]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def to_json(self, indent: int | None = 2) -> str:
        """The rows as JSON (inf and NaN written as strings)."""

        def clean(v: object) -> object:
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            if isinstance(v, (list, tuple)):
                return [clean(x) for x in v]
            return v

        return json.dumps([{k: clean(v) for k, v in r.items()} for r in self.rows], indent=indent)

    def suggestions(self) -> list[str]:
        """For each layer with a large error, the policy edit that keeps it out of FP8."""
        return [
            f"{s.module}: FP8 error {s.error:.1%} > {LARGE_ERROR:.0%}; keep it in the low dtype "
            f"with policy.fp8('!{s.module}')"
            for s in self.layers
            if s.large_error
        ]

    def __str__(self) -> str:
        if not self.layers:
            return "no FP8 layers (mixprec.to_fp8 or initialize(..., fp8=...) converts them)"
        head = (f"{'layer':<28} {'recipe':<11} {'formats in/w/grad':<18} {'scale in/w/grad':<29} "
                f"{'amax in/w/grad':<29} {'error':<7} gemm")  # fmt: skip
        modes = sorted({s.quantize for s in self.layers})
        lines = [f"FP8 layers: {len(self.layers)} (quantisation: {', '.join(modes)})", head]
        for s in self.layers:
            err = "-" if s.error is None else f"{s.error:.2%}"
            fmts = s.formats.replace(" x ", "/").replace(", grad ", "/")
            lines.append(
                f"{_clip(s.module, 28):<28} {s.recipe:<11} {fmts:<18} "
                f"{_three(s.scale):<29} {_three(s.amax):<29} {err:<7} {s.gemm}"
            )
        lines += [f"suggested: {text}" for text in self.suggestions()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Fp8Report {len(self.layers)} layers>"


def _three(values: tuple[float, ...]) -> str:
    return "/".join(f"{v:.3g}" for v in values)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "~"


def fp8_report(model: nn.Module) -> Fp8Report:
    """The scales, amaxes and FP8 error of each `Fp8Linear` in `model`. One host sync."""
    layers = fp8_layers(model)
    if not layers:
        return Fp8Report([])
    with torch.no_grad():
        rows = []
        for _, m in layers:
            pending = torch.cat([m.fp8_fwd[:2], m.pending_grad_amax().reshape(1)])
            newest = m.fp8_history[:, 0].to(pending.device)
            last = torch.where(pending > 0, pending, newest)
            window = torch.maximum(m.fp8_history.amax(dim=1), pending)
            used = torch.cat([m.fp8_fwd[2:], m.fp8_bwd[1:]])
            rows.append(torch.cat([used, m.fp8_scale, last, window, m.fp8_error.reshape(1)]))
        values = torch.stack([r.float().cpu() for r in rows]).tolist()
    out = []
    for (name, m), v in zip(layers, values, strict=True):
        out.append(Fp8LayerStats(
            module=name, recipe=m.fp8_recipe.name, reason=m.fp8_reason,
            scale=tuple(v[0:3]), delayed_scale=tuple(v[3:6]), amax=tuple(v[6:9]),
            window_amax=tuple(v[9:12]), error=None if math.isnan(v[12]) else v[12],
            formats=formats(m.fp8_recipe), gemm=gemm_summary(m),
            quantize="compiled" if fused.use_compiled(m.weight) else "eager",
        ))  # fmt: skip
    return Fp8Report(out)


def formats(recipe: Fp8Recipe) -> str:
    """``'e4m3 x e4m3, grad e5m2'``: the formats of input, weight and output gradient."""
    fwd = format_name(recipe.forward_dtype)
    return f"{fwd} x {fwd}, grad {format_name(recipe.grad_dtype)}"


def gemm_summary(layer: Fp8Linear) -> str:
    """Which path the layer's products took on its last batch (see `mixprec.fp8.gemm`)."""
    if layer.fp8_tokens == 0:
        return "not run"
    if layer.fp8_recipe.emulate:
        return "emulate (recipe)"
    paths = gemm.layer_paths(layer.weight.device, layer.fp8_recipe.rowwise, layer.fp8_tokens,
                             layer.in_features, layer.out_features)  # fmt: skip
    return gemm.summary(paths)
