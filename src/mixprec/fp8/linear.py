"""`Fp8Linear`: an ``nn.Linear`` whose three matmuls run in FP8, with its scaling state on device.

Not built directly: `mixprec.to_fp8` (or ``initialize(..., fp8=...)``) swaps the linear layers
a policy selects for one of these. The new module *shares* the old one's ``weight`` and ``bias``
Parameter objects (optimizers, tied weights and user references stay valid) and adds buffers:

- ``fp8_history`` (3, H) and ``fp8_scale`` (3,): the delayed-scaling state of the input, the
  weight and the output gradient (`mixprec.fp8.state`); saved in ``state_dict``;
- ``fp8_fwd`` (4,): this step's amax of input and weight, and the scales last used for them;
- ``fp8_bwd`` (2,): this step's amax of the output gradient, and the scale last used for it;
- ``fp8_error`` (): the relative error of the last forward's output against fp32, when
  `measure_error` is on (`mixprec.explain` and ``watch_nonfinite(fp8_error=True)`` turn it on).

All five stay fp32 whatever the model is cast to (``model.bfloat16()``, O2's cast): a scale in
bf16 would lose the precision of the history it comes from.

The output dtype is the one an autocast linear would give: the region's low dtype inside an
autocast region (mixprec's or torch's, on the input's device), else the input's dtype. The bias
is added in that dtype, outside the FP8 op, so autograd forms its gradient as for ``F.linear``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mixprec.fp8 import ops  # noqa: F401 - registers the mixprec::fp8_linear custom ops
from mixprec.fp8.ops import _plain
from mixprec.fp8.recipe import E5M2, Fp8Recipe
from mixprec.fp8.state import init_state

__all__ = ["Fp8Linear"]

_FP8_BUFFERS = ("fp8_history", "fp8_scale", "fp8_fwd", "fp8_bwd", "fp8_error")
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
        # Eager only: backward slots lent to calls whose backward has not run yet (a layer
        # called twice before one backward, e.g. a siamese model); see _grad_slot.
        self._lent_version = -1
        self._extra_slots: list[torch.Tensor] = []

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.summary()}"

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.fp8_recipe
        out_dtype = _output_dtype(x)
        x2 = x.reshape(-1, self.in_features)
        out, _, _, _, _, stats = torch.ops.mixprec.fp8_linear(
            x2, self.weight, self.fp8_scale, self._grad_slot(), out_dtype,
            r.grad_dtype is E5M2, r.rowwise, r.delayed, r.overflow == "saturate",
            r.power_of_two, r.fast_accum, r.emulate,
        )  # fmt: skip
        torch.ops.mixprec.fp8_record(self.fp8_fwd, stats)
        if self.measure_error:
            self._measure(x2, out)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

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
        """Forget this step's amaxes (after an update); the last-used scales stay for reports."""
        self._extra_slots = []
        self._lent_version = -1

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
