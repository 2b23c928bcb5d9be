"""Unscaling and the non-finite check, one pass per (device, dtype) group of gradients.

Two implementations, bit-identical on the gradients:

- ``"torch"`` (the default, ``"auto"``): torch's fused multi-tensor kernel
  ``_amp_foreach_non_finite_check_and_unscale_``, one read and one write of every gradient.
- ``"foreach"``: mixprec's composition of multi-tensor ``_foreach`` kernels: one in-place
  multiply by ``1/scale``, then one max-|g| reduction per group that decides ``found_inf``. It
  checks the *unscaled* values (a gradient that only becomes inf when unscaled by a scale below 1
  is caught too), at the cost of a second read: about 1.5x the fused kernel's memory traffic.
  It is the fallback for devices without the fused kernel.

``benchmarks/scaler_overhead.py`` measures both against torch's scaler. Nothing here reads a
value back to the host, and nothing here communicates: DTensor gradients (FSDP2) are processed
as this rank's local shards, and the scaler agrees on overflows across ranks itself.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from mixprec._compat import local_tensor
from mixprec.errors import MixprecError
from mixprec.scaling.state import ScalerConfigError

__all__ = ["IMPLS", "GradGroups", "check_finite_", "group_grads", "unscale_and_check_"]

#: Valid values of ``GradScaler(unscale_impl=...)``.
IMPLS = ("auto", "torch", "foreach")

#: device -> dtype -> the gradient tensors (values of sparse gradients) to process.
GradGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]

_FP16_MESSAGE = (
    "the optimizer holds fp16 gradients (parameter {name}shape {shape}). A loss scaler cannot "
    "unscale them in place: unscaled fp16 gradients lose their small values to underflow, "
    "which is the very thing scaling protects against. Keep the model's weights in fp32 and let "
    "autocast run its ops in fp16 (mixprec.autocast, opt level O1), or keep fp32 master weights "
    "for an fp16 model and give the optimizer those (opt level O2: mixprec.initialize(model, "
    "optimizer, opt_level='O2')), so that gradients reach the optimizer in fp32."
)


class Fp16GradientError(MixprecError, ValueError):
    """Gradients the scaler must unscale are fp16: the model's parameters are fp16."""


def group_grads(
    params: Iterable[torch.Tensor], *, allow_fp16: bool = False, names: dict[int, str] | None = None
) -> GradGroups:
    """Gather the gradients of `params` by device and dtype (sparse: their coalesced values)."""
    groups: GradGroups = defaultdict(lambda: defaultdict(list))
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if grad.dtype == torch.float16 and not allow_fp16:
            name = (names or {}).get(id(param))
            raise Fp16GradientError(
                _FP16_MESSAGE.format(name=f"{name!r}, " if name else "", shape=tuple(param.shape))
            )
        if grad.is_sparse:
            # Duplicate indices are summed by coalesce(); in fp16 the sums can overflow where
            # the parts did not, so check the coalesced values (as torch does).
            if grad.dtype == torch.float16:
                grad = grad.coalesce()
                param.grad = grad
            grad = grad._values()
        # A DTensor gradient (FSDP2) is processed as this rank's shard: in place, so the DTensor
        # sees the unscaled values, and without DTensor's blocking all-reduce of found_inf (the
        # scaler agrees across ranks itself, once per step, asynchronously).
        grad = local_tensor(grad)
        groups[grad.device][grad.dtype].append(grad)
    return groups


def check_finite_(grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Add the number of non-finite tensors in `grads` to `found_inf` (0-dim fp32, same device)."""
    if not grads:
        return
    peaks = torch._foreach_norm(grads, float("inf"))
    bad = torch.logical_not(torch.isfinite(torch.stack(peaks))).sum(dtype=torch.float32)
    found_inf.add_(bad)


def unscale_and_check_(
    grads: list[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    impl: str = "foreach",
) -> None:
    """Multiply `grads` in place by `inv_scale` and count the non-finite ones into `found_inf`.

    Args:
        grads: same device and dtype.
        inv_scale: 0-dim fp32 on that device.
        found_inf: 0-dim fp32 on that device; incremented when a gradient is not finite.
        impl: ``"auto"``/``"torch"`` (torch's fused kernel) or ``"foreach"`` (mixprec's).
    """
    if not grads:
        return
    with torch.no_grad():
        _unscale_and_check(grads, inv_scale, found_inf, impl)


def _unscale_and_check(grads, inv_scale, found_inf, impl):
    if impl == "auto":
        fused = hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
        impl = "torch" if fused else "foreach"
    if impl == "foreach":
        torch._foreach_mul_(grads, inv_scale)
        check_finite_(grads, found_inf)
    elif impl == "torch":
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    else:  # pragma: no cover - validated by the scaler's constructor
        raise ScalerConfigError(f"unknown unscale implementation {impl!r}; valid: {IMPLS}")
