"""FP8 recipes: named, frozen, printable configs saying how each FP8 matmul scales its operands.

An FP8 linear layer runs three matmuls per step, each on two quantised operands::

    forward      out        = input      @ weight.T     (e4m3 x e4m3)
    backward     grad_input = grad_out   @ weight       (grad dtype x e4m3)
                 grad_weight= grad_out.T @ input        (grad dtype x e4m3)

Every operand is multiplied by a *scale* before the cast to FP8, so that its largest magnitude
(its *amax*) lands near the top of the format (448 for e4m3, 57344 for e5m2), and the product is
divided by both scales again inside ``torch._scaled_mm`` (which accumulates in fp32). A recipe
says how the scales are chosen:

- ``tensorwise`` (dynamic): one scale per tensor, from the tensor's own amax in this step. Never
  saturates; one extra read of each operand (the amax) before its cast. torchao's default.
- ``delayed``: one scale per tensor from the largest amax of the last ``history_len`` steps
  (Transformer Engine's DelayedScaling: ``scale = fmax / amax / 2**margin``). The histories live
  on the device and advance once per optimizer step, not at all on a skipped step. mixprec
  also caps the delayed scale by the current amax (``overflow='rescale'``), so an outlier batch
  is rescaled rather than clipped; this needs the current amax before every cast, as dynamic
  scaling does. ``overflow='saturate'`` is *true* delayed scaling (Transformer Engine's): the
  cast takes the delayed scale as it is, with no pass over the operand before it; the amax
  the history needs is read from the FP8 bytes after the cast (one byte per element), and an
  operand that outgrew its scale is clipped to +-fmax and recorded at twice the clipping
  threshold, so its scale halves each step until it fits.
- Outliers in the history (``max_growth``): an amax entering a history may exceed the
  window's current largest by at most this factor (4 by default). One outlier batch then
  shrinks the next steps' scales by at most 4x (2 bits of range, no precision in e4m3's
  normal range) instead of by the outlier's size for ``history_len`` steps; a real growth of
  g is adopted in ``ceil(log4 g)`` steps. ``max_growth=float('inf')`` is TE's window max.
- ``rowwise`` (dynamic): one scale per row of each operand along the matmul's reduction
  dimension (torchao's rowwise recipe), which isolates outlier rows; scales are powers of two.

Every recipe casts with saturation: a value beyond +-fmax (only possible under
``overflow='saturate'``) becomes +-fmax, never inf, so FP8 itself never makes an inf or a NaN.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

import torch

from mixprec.errors import PolicyError, format_options

__all__ = ["RECIPES", "Fp8Recipe", "fp8_max"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

_FORMAT_NAMES = {"e4m3": E4M3, "e5m2": E5M2}
_SCALINGS = ("dynamic", "delayed")
_GRANULARITIES = ("tensorwise", "rowwise")
_AMAX_COMPUTE = ("max", "most_recent")
_OVERFLOW = ("rescale", "saturate")


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 format (448.0 for e4m3, 57344.0 for e5m2)."""
    return float(torch.finfo(dtype).max)


def format_name(dtype: torch.dtype) -> str:
    """``'e4m3'`` or ``'e5m2'``."""
    return next(k for k, v in _FORMAT_NAMES.items() if v is dtype)


def _one_of(field: str, value: object, options: tuple[str, ...]) -> None:
    if isinstance(value, str) and value in options:
        return
    close = difflib.get_close_matches(str(value), options, n=1)
    raise PolicyError(
        f"Fp8Recipe {field}={value!r} is not valid."
        + (f" Did you mean {close[0]!r}?" if close else "")
        + f" Valid values: {format_options(options)}."
    )


@dataclass(frozen=True)
class Fp8Recipe:
    """How an FP8 linear layer quantises its operands (see the module docstring).

    Attributes:
        name: the recipe's name (``'custom'`` for one built by hand).
        scaling: ``'dynamic'`` (scale from this step's amax) or ``'delayed'`` (from the amax
            history of past steps).
        granularity: ``'tensorwise'`` (one scale per tensor) or ``'rowwise'`` (one per row
            along the reduction dimension; dynamic only).
        grad_dtype: the format of the output gradient: ``'e5m2'`` (range 57344, 2 mantissa
            bits: Transformer Engine's HYBRID) or ``'e4m3'`` (448, 3 bits).
        history_len: delayed scaling's window: how many past steps' amaxes are kept (>= 1).
        amax_compute: ``'max'`` over the window, or ``'most_recent'`` (delayed only).
        margin: delayed scaling divides its scale by ``2**margin`` (headroom for growth).
        overflow: delayed scaling when the current amax exceeds what the delayed scale allows:
            ``'rescale'`` (use the current amax's scale: nothing is clipped; costs the current
            amax before each cast) or ``'saturate'`` (true delayed scaling: cast with the
            delayed scale as it is, clip to +-fmax, as Transformer Engine does).
        max_growth: the most an amax entering a delayed history may exceed the window's
            largest entry, as a factor (> 1; ``float('inf')``: no bound, TE's window max).
        power_of_two: round every scale down to a power of two, so that scaling and unscaling
            are exact (no rounding beyond the cast to FP8). Costs up to 1 bit of range.
        fast_accum: use the tensor cores' fast (less precise) accumulation in the forward matmul
            (as torchao and Transformer Engine do); the backward matmuls never use it.
        emulate: run every matmul as dequantise-then-matmul in fp32 instead of
            ``torch._scaled_mm``: the same quantisation on any device, without FP8 hardware.
    """

    name: str = "custom"
    scaling: str = "dynamic"
    granularity: str = "tensorwise"
    grad_dtype: torch.dtype = E5M2
    history_len: int = 16
    amax_compute: str = "max"
    margin: int = 0
    overflow: str = "rescale"
    max_growth: float = 4.0
    power_of_two: bool = False
    fast_accum: bool = True
    emulate: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PolicyError(f"Fp8Recipe name={self.name!r} must be a non-empty string.")
        _one_of("scaling", self.scaling, _SCALINGS)
        _one_of("granularity", self.granularity, _GRANULARITIES)
        _one_of("amax_compute", self.amax_compute, _AMAX_COMPUTE)
        _one_of("overflow", self.overflow, _OVERFLOW)
        grad = self.grad_dtype
        if isinstance(grad, str):
            key = grad.strip().lower().removeprefix("float8_").removesuffix("fn")
            if key not in _FORMAT_NAMES:
                raise PolicyError(
                    f"Fp8Recipe grad_dtype={grad!r} is not an FP8 format. Valid: "
                    f"{format_options(_FORMAT_NAMES)} (or torch.float8_e5m2 / "
                    f"torch.float8_e4m3fn)."
                )
            grad = _FORMAT_NAMES[key]
        if grad not in (E4M3, E5M2):
            raise PolicyError(
                f"Fp8Recipe grad_dtype={grad!r} is not an FP8 format. Valid: "
                f"{format_options(_FORMAT_NAMES)}."
            )
        # Our own field, normalised while the object is being built (never a shared object).
        object.__setattr__(self, "grad_dtype", grad)
        for field, low in (("history_len", 1), ("margin", 0)):
            value = getattr(self, field)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise PolicyError(f"Fp8Recipe {field}={value!r} must be an int >= {low}.")
        growth = self.max_growth
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not growth > 1:
            raise PolicyError(
                f"Fp8Recipe max_growth={growth!r} must be a number > 1 (how many times the "
                f"window's largest amax a new one may be), or float('inf') for no bound."
            )
        object.__setattr__(self, "max_growth", float(growth))
        for field in ("power_of_two", "fast_accum", "emulate"):
            if not isinstance(getattr(self, field), bool):
                raise PolicyError(f"Fp8Recipe {field}={getattr(self, field)!r} must be a bool.")
        if self.granularity == "rowwise" and self.scaling != "dynamic":
            raise PolicyError(
                "Fp8Recipe: rowwise scaling is dynamic only (a delayed rowwise scale would need "
                "one amax history per row, and rows are tokens that change every step). Use "
                "scaling='dynamic' with granularity='rowwise', or granularity='tensorwise' for "
                "delayed scaling."
            )
        if self.granularity == "rowwise" and grad is E5M2 and not self.emulate:
            raise PolicyError(
                "Fp8Recipe: rowwise scaling takes e4m3 gradients (grad_dtype='e4m3'): torch's "
                "rowwise-scaled GEMM kernels are built for e4m3 operands (torchao's rowwise "
                "recipe uses e4m3 throughout). Per-row scales give e4m3 the range it lacks."
            )

    # ----- construction

    @classmethod
    def named(cls, name: str | Fp8Recipe) -> Fp8Recipe:
        """The recipe called `name` (see `RECIPES`); a recipe is returned as it is."""
        if isinstance(name, Fp8Recipe):
            return name
        if isinstance(name, str) and name.strip().lower() in RECIPES:
            return RECIPES[name.strip().lower()]
        close = difflib.get_close_matches(str(name), RECIPES, n=1)
        raise PolicyError(
            f"unknown FP8 recipe {name!r}."
            + (f" Did you mean {close[0]!r}?" if close else "")
            + f" Valid recipes: {format_options(RECIPES)}; or build one with "
            f"mixprec.Fp8Recipe(scaling=..., granularity=..., ...)."
        )

    def replace(self, **changes: object) -> Fp8Recipe:
        """A copy with `changes` applied and validated (named ``'<name>+'`` if it differs)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise PolicyError(
                f"Fp8Recipe has no field {unknown[0]!r}. Fields: "
                f"{format_options(f.name for f in dataclasses.fields(self))}."
            )
        if "name" not in changes and self.name in RECIPES:
            changes["name"] = self.name + "+"
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    # ----- derived

    @property
    def forward_dtype(self) -> torch.dtype:
        """The format of inputs and weights: always e4m3 (3 mantissa bits, max 448)."""
        return E4M3

    @property
    def delayed(self) -> bool:
        """Whether scales come from an amax history (and need ``fp8_update`` every step)."""
        return self.scaling == "delayed"

    @property
    def true_delayed(self) -> bool:
        """Whether casts take the delayed scale as it is, with no current-amax pass before them
        (``scaling='delayed'``, ``overflow='saturate'``)."""
        return self.delayed and self.overflow == "saturate"

    @property
    def rowwise(self) -> bool:
        """Whether scales are per row."""
        return self.granularity == "rowwise"

    def summary(self) -> str:
        """One line: ``delayed (tensorwise, e4m3/e5m2, history 16 max, margin 0, rescale)``."""
        parts = [self.granularity, f"e4m3/{format_name(self.grad_dtype)}"]
        if self.delayed:
            growth = "" if self.max_growth == float("inf") else f" (growth <= {self.max_growth:g}x)"
            parts += [f"history {self.history_len} {self.amax_compute}{growth}",
                      f"margin {self.margin}", self.overflow]  # fmt: skip
        if self.power_of_two:
            parts.append("power-of-two scales")
        if self.emulate:
            parts.append("emulated")
        return f"{self.name}: {self.scaling} {', '.join(parts)}"

    def __str__(self) -> str:
        lines = [f"Fp8Recipe {self.summary()}", f"  {_DESCRIPTIONS.get(self.name, _CUSTOM)}"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            shown = format_name(value) if isinstance(value, torch.dtype) else value
            lines.append(f"  {f.name:13s} = {shown}")
        return "\n".join(lines)


_CUSTOM = "A recipe built by hand."
_DESCRIPTIONS = {
    "tensorwise": "One scale per tensor from its current amax (torchao's default): nothing "
    "saturates, no state to keep; costs one amax pass per operand.",
    "delayed": "One scale per tensor from the max amax of the last 16 steps (Transformer "
    "Engine's DelayedScaling), capped by the current amax so an outlier never clips; an outlier "
    "raises the history by at most 4x. replace(overflow='saturate') skips the current-amax "
    "pass (true delayed scaling).",
    "rowwise": "One power-of-two scale per row along the reduction dimension (torchao's "
    "rowwise recipe): an outlier row only costs its own row's precision; e4m3 everywhere.",
}

#: The named recipes (``Fp8Recipe.named(name)``; ``print(recipe)`` explains each field).
RECIPES: dict[str, Fp8Recipe] = {
    "tensorwise": Fp8Recipe("tensorwise"),
    "delayed": Fp8Recipe("delayed", scaling="delayed"),
    "rowwise": Fp8Recipe("rowwise", granularity="rowwise", grad_dtype=E4M3, power_of_two=True),
}
