"""`Fp8Linear`: an ``nn.Linear`` whose three matmuls run in FP8, with its scaling state on device.

Not built directly: `mixprec.to_fp8` (or ``initialize(..., fp8=...)``) swaps the linear layers
a policy selects for one of these. The new module *shares* the old one's ``weight`` and ``bias``
Parameter objects (optimizers, tied weights and user references stay valid) and adds buffers:

- ``fp8_history`` (3, H) and ``fp8_scale`` (3,): the delayed-scaling state of the input, the
  weight and the output gradient (`mixprec.fp8.state`); saved in ``state_dict``;
- ``fp8_fwd`` (4,): this step's amax of input and weight, and the scales last used for them;
- ``fp8_bwd`` (2,): this step's amax of the output gradient, and the scale last used for it;
- ``fp8_error`` (): the relative error of the last forward's output against fp32, when
  `measure_error` is on (`mixprec.explain` and ``watch_nonfinite(fp8_error=True)`` turn it on);
- ``fp8_next`` (3,), true delayed scaling only (``overflow='saturate'``): the scales the next
  step casts with, as they are (`mixprec.fp8.convert.fp8_update` sets them); saved in
  ``state_dict``.

All of them stay fp32 whatever the model is cast to (``model.bfloat16()``, O2's cast): a scale
in bf16 would lose the precision of the history it comes from.

**The weight's cast is cached** across the forwards of one optimizer step (the micro-batches
of gradient accumulation, a layer called twice): the FP8 weight and its scale are kept while
the weight is the same tensor at the same version (any in-place change, the optimizer's step
or O2's refresh from the masters, bumps it) and the delayed scales are unchanged. Tensorwise
recipes, eager mode only (a compiled graph or a CUDA graph quantises on every call); it keeps
1 byte per weight element (the copy the backward saves anyway) until the next update.

Under FSDP2 with FP8 all-gather (`mixprec.fully_shard(..., fp8=...)`), the weight FSDP2 sets
on the layer arrives quantised, with its scale, computed once per all-gather: it is used as it
is (`mixprec.distributed.fp8`).

The output dtype is the one an autocast linear would give: the region's low dtype inside an
autocast region (mixprec's or torch's, on the input's device), else the input's dtype. The bias
is added in that dtype, outside the FP8 op, so autograd forms its gradient as for ``F.linear``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mixprec._compat import capturing
from mixprec.fp8 import ops  # noqa: F401 - registers the mixprec::fp8_linear custom ops
from mixprec.fp8.ops import _plain
from mixprec.fp8.recipe import E5M2, Fp8Recipe
from mixprec.fp8.state import init_state

__all__ = ["Fp8Linear"]

_FP8_BUFFERS = ("fp8_history", "fp8_scale", "fp8_fwd", "fp8_bwd", "fp8_error", "fp8_next")
_MAX_EXTRA_SLOTS = 16


class Fp8Linear(nn.Linear):
    """A linear layer computing ``x @ W.T + b`` with FP8 matmuls (see the module docstring).

    Attributes:
        fp8_recipe: the `Fp8Recipe` its matmuls follow.
        fp8_reason: why the policy put this layer in FP8 (what ``explain`` prints).
        measure_error: also compute the fp32 product each forward and record the relative
            error of the FP8 output in ``fp8_error`` (costs one fp32 matmul per forward).
    """

    #: Buffers ``initialize``'s model cast leaves in fp32 (see `mixprec.levels.model`).
    mixprec_fp32_buffers = _FP8_BUFFERS

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: Fp8Recipe | str = "tensorwise",
        reason: str = "built as an Fp8Linear",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_fp8(Fp8Recipe.named(recipe), reason, self.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe, reason: str) -> Fp8Linear:
        """An Fp8Linear over `linear`'s own Parameters (no copy), hooks and training mode."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.training = linear.training
        # The user's hooks on the layer keep running on its replacement.
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                     "_backward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):  # fmt: skip
            if hasattr(linear, attr):
                getattr(new, attr).update(getattr(linear, attr))
        new._init_fp8(recipe, reason, linear.weight.device)
        return new

    def _init_fp8(self, recipe: Fp8Recipe, reason: str, device: torch.device) -> None:
        self.fp8_recipe = recipe
        self.fp8_reason = reason
        self.measure_error = False
        state = init_state(recipe, device)
        self.register_buffer("fp8_history", state.history)
        self.register_buffer("fp8_scale", state.scale)
        zeros = {"dtype": torch.float32, "device": device}
        self.register_buffer("fp8_fwd", torch.zeros(4, **zeros), persistent=False)
        self.register_buffer("fp8_bwd", torch.zeros(2, **zeros), persistent=False)
        self.register_buffer("fp8_error", torch.full((), math.nan, **zeros), persistent=False)
        # True delayed scaling casts with fp8_next as it is; until the first update there is
        # none, and the layer scales dynamically (a Python flag: no read of device values).
        self.register_buffer("fp8_next", torch.full((3,), math.nan, **zeros),
                             persistent=recipe.true_delayed)  # fmt: skip
        self.fp8_ready = False
        self.fp8_amax_group: Any = None  # a process group agreeing on amaxes (to_fp8 says when)
        # Eager only: backward slots lent to calls whose backward has not run yet (a layer
        # called twice before one backward, e.g. a siamese model); see _grad_slot.
        self._lent_version = -1
        self._extra_slots: list[torch.Tensor] = []
        # (key, FP8 weight, inverse scale, stats of the forward that made it)
        self._weight_cache: tuple[Any, ...] | None = None
        self.fp8_tokens = 0  # rows of the last forward (which GEMM shape classes it used)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.summary()}"

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.fp8_recipe
        out_dtype = _output_dtype(x)
        x2 = x.reshape(-1, self.in_features)
        delayed, scales = r.delayed, self.fp8_scale
        if r.true_delayed:  # cast with the scales fp8_update prepared; none yet: dynamic
            delayed, scales = self.fp8_ready, self.fp8_next
        wq, wq_inv, wq_stats = self._cached_weight(scales)
        out, _, _, qw, inv_w, stats = torch.ops.mixprec.fp8_linear(
            x2, self.weight, scales, self._grad_slot(), out_dtype,
            r.grad_dtype is E5M2, r.rowwise, delayed, r.overflow == "saturate",
            r.power_of_two, r.fast_accum, r.emulate, wq, wq_inv, wq_stats,
        )  # fmt: skip
        if wq is None and self._weight_cache is not None:
            self._weight_cache = (self._weight_cache[0], qw, inv_w, stats)
        torch.ops.mixprec.fp8_record(self.fp8_fwd, stats)
        if not torch.compiler.is_compiling():
            self.fp8_tokens = x2.shape[0]
        if self.measure_error:
            self._measure(x2, out)
        if x.dim() != 2:
            out = out.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:  # after the reshape: the layer returns no view (FSDP2 asks)
            out = out + self.bias.to(out.dtype)
        return out

    def _cached_weight(self, scales: torch.Tensor) -> tuple[Any, Any, Any]:
        """(FP8 weight, inverse scale, stats) to use instead of quantising, or Nones.

        Sets ``_weight_cache`` to a fresh key (and no tensors) when this call must quantise
        and may keep the result.
        """
        gathered = getattr(self.weight, "fp8_gathered", None)
        if gathered is not None:  # FSDP2 all-gathered it in FP8, with its scale
            return gathered()
        if self.fp8_recipe.rowwise or torch.compiler.is_compiling() or capturing():
            self._weight_cache = None
            return None, None, None
        w = self.weight
        key = (id(w), w._version, id(scales), scales._version, self.fp8_ready)
        cache = self._weight_cache
        if cache is not None and cache[0] == key and cache[1] is not None:
            return cache[1], cache[2], cache[3]
        self._weight_cache = (key, None, None, None)
        return None, None, None

    def _grad_slot(self) -> torch.Tensor:
        """The buffer the backward op records the output gradient's amax into.

        Normally ``fp8_bwd``. A tensor saved for backward must not change before its backward
        runs, and each backward writes its slot; so a second call made while the first call's
        backward is pending (seen from the buffer's version counter, which every backward
        bumps) gets a fresh slot, folded into ``fp8_bwd`` by the next update. Compiled code
        always gets ``fp8_bwd``: a compiled backward orders its writes itself.
        """
        buf = self.fp8_bwd
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return buf
        if buf._version != self._lent_version:
            self._lent_version = buf._version
            return buf
        slot = torch.zeros_like(buf)
        self._extra_slots = [*self._extra_slots[-_MAX_EXTRA_SLOTS + 1 :], slot]
        return slot

    def pending_grad_amax(self) -> torch.Tensor:
        """This step's largest output-gradient amax (0-dim), extra slots included."""
        amax = self.fp8_bwd[0]
        for slot in self._extra_slots:
            amax = torch.maximum(amax, slot[0])
        return amax

    def clear_pending(self) -> None:
        """Forget this step's amaxes and the cached weight cast (after an update); the
        last-used scales stay for reports."""
        self._extra_slots = []
        self._lent_version = -1
        self._weight_cache = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:  # fmt: skip
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)  # fmt: skip
        key = prefix + "fp8_next"
        if self.fp8_recipe.true_delayed and key in missing_keys:
            # Saved before fp8_next existed: the delayed scales are the next ones (where there
            # are none yet, the layer scales dynamically again).
            missing_keys.remove(key)
            with torch.no_grad():
                valid = torch.isfinite(self.fp8_scale) & (self.fp8_scale > 0)
                self.fp8_next.copy_(torch.where(valid, self.fp8_scale, math.nan))
        self.fp8_loaded()

    def fp8_loaded(self) -> None:
        """The state was loaded from a checkpoint: the cached weight cast is stale, and true
        delayed scaling is ready if the loaded ``fp8_next`` holds scales (one host sync)."""
        self._weight_cache = None
        if self.fp8_recipe.true_delayed:
            self.fp8_ready = bool(torch.isfinite(self.fp8_next).all())

    def _measure(self, x2: torch.Tensor, out: torch.Tensor) -> None:
        with torch.no_grad(), _plain():
            ref = torch.mm(x2.float(), self.weight.float().t())
            err = torch.linalg.vector_norm(out.float() - ref) / torch.clamp(
                torch.linalg.vector_norm(ref), min=torch.finfo(torch.float32).tiny
            )
            self.fp8_error.copy_(err)

    # ------------------------------------------------------------------ dtype safety

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # model.to(device) moves the FP8 state; model.half()/.bfloat16() must not cast it.
        before = {k: self._buffers[k] for k in _FP8_BUFFERS if self._buffers.get(k) is not None}
        out = super()._apply(fn, recurse)
        for key, old in before.items():
            new = self._buffers[key]
            if new is not None and new.dtype != old.dtype:
                self._buffers[key] = old.to(new.device)
        return out


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """What an autocast linear returns: the region's low dtype on x's device, else x's dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()
