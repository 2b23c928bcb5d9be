"""Gradient underflow per module, and what to do about it.

`mixprec.grad_underflow` measures, per parameter, the gradient elements that flush to zero in
fp16 at the current loss scale, and at twice the scale. Here they are grouped by the module that
owns the parameters, and each module past a threshold gets its fix in words:

- if twice the scale lifts its elements and overflows nowhere, the scale is too low: raise it
  (``min_loss_scale``, or a larger ``init_scale``; the dynamic scaler also grows it by itself
  after ``growth_interval`` clean steps);
- if twice the scale would overflow (the scale is at its ceiling, set by other gradients), no
  scale serves both: keep the module in fp32 (``Policy().keep_fp32(module)``), whose backward
  then computes its gradients in fp32, where they do not flush.

bf16 has fp32's exponent range: a bf16 gradient that flushes is below 1e-38, which no scale
should chase; the advice says so. `fix` applies the second kind to a policy.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.dtypes import dtype_name
from mixprec.policy.policy import Policy

__all__ = ["advise", "by_module", "fix"]


def by_module(report: Any) -> list[dict[str, Any]]:
    """`report` (an `UnderflowReport`) summed per owning module, element-weighted: ``module``,
    ``numel``, ``flushed``, ``flushed_2x``, ``overflow_2x`` (any of the report's gradients would
    overflow at 2x: the scale is shared), ``headroom`` (how many times the largest gradient
    could grow before it overflows), worst first."""
    groups: dict[str, dict[str, Any]] = {}
    for row in report.rows:
        module = row["param"].rpartition(".")[0]
        g = groups.setdefault(module, {"module": module, "numel": 0, "flushed": 0.0,
                                       "flushed_2x": 0.0})  # fmt: skip
        g["numel"] += row["numel"]
        g["flushed"] += row["flushed"] * row["numel"]
        g["flushed_2x"] += row["flushed_2x"] * row["numel"]
    overflow = any(r["overflow_2x"] for r in report.rows)
    peak = max((r["max_abs"] for r in report.rows), default=0.0)
    headroom = torch.finfo(report.dtype).max / peak if peak > 0 else None
    out = []
    for g in groups.values():
        n = g["numel"] or 1
        out.append({**g, "flushed": g["flushed"] / n, "flushed_2x": g["flushed_2x"] / n,
                    "overflow_2x": overflow, "headroom": headroom})  # fmt: skip
    return sorted(out, key=lambda g: -g["flushed"])


def advise(module: str, flushed: float, scale: float, dtype: torch.dtype, *,
           overflow_at_2x: bool, flushed_2x: float | None = None,
           headroom: float | None = None) -> str:  # fmt: skip
    """The fix for `module`, whose gradients flush to zero (fraction `flushed`) at `scale`;
    `headroom`: how many times the largest gradient could grow before it overflows."""
    name = dtype_name(dtype)
    where = repr(module) if module else "the model's own parameters"
    head = (f"{where}: {flushed:.1%} of its gradient elements flush to zero in {name} at loss "
            f"scale {scale:g}")  # fmt: skip
    if dtype == torch.bfloat16:
        return (
            f"{head}; bf16 has fp32's exponent range, so these are below 1e-38: no scale "
            f"should chase them. If they matter, keep it in fp32: "
            f"mixprec.Policy().keep_fp32({module!r})."
        )
    keep = f"policy=mixprec.Policy().keep_fp32({module!r}) (its backward then computes in fp32)"
    if not overflow_at_2x:
        if flushed_2x is None:
            lifted = "twice the scale overflows nowhere"
        elif flushed_2x < flushed:
            lifted = (f"twice the scale lifts {flushed - flushed_2x:.1%} of the elements and "
                      f"overflows nowhere")  # fmt: skip
        else:
            lifted = ("twice the scale lifts none of them (they sit far below the smallest "
                      "subnormal) and overflows nowhere")  # fmt: skip
        room = (f"; the largest gradient leaves room for {headroom:.3g}x more"
                if headroom is not None and headroom > 2 else "")  # fmt: skip
        return (
            f"{head}; {lifted}, so the scale is too low{room}: raise it "
            f"(min_loss_scale, or a larger init_scale; the dynamic scaler grows it by "
            f"itself after growth_interval clean steps), or keep it in fp32: {keep}."
        )
    return (
        f"{head}, and the scale cannot go higher (twice it overflows other gradients): "
        f"keep it in fp32: {keep}."
    )


def fix(report: Any, policy: Policy | None = None, threshold: float = 0.01) -> Policy:
    """`policy` with the modules kept in fp32 whose gradients flush past `threshold` where no
    higher scale can lift them (twice the scale overflows); the others need a higher scale,
    which is the scaler's setting, not the policy's (see `advise`)."""
    policy = policy if policy is not None else Policy()
    if not any(r["overflow_2x"] for r in report.rows):
        return policy
    names = [g["module"] for g in by_module(report) if g["flushed"] > threshold and g["module"]]
    return policy.keep_fp32(*names) if names else policy
