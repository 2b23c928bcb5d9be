"""FP8 training: FP8 linear layers chosen by the policy, with recipes and sync-free scaling.

- `recipe`: `Fp8Recipe`, the named recipes (tensorwise, delayed, rowwise);
- `numerics`: amax, scales, saturating casts and the scaled matmul;
- `gemm`: which FP8 GEMM runs (``_scaled_mm`` or emulation), measured per machine and shape;
- `ops`: ``mixprec::fp8_linear`` and its backward, as torch custom ops;
- `state`: the delayed-scaling history and its pure, sync-free update;
- `linear`: `Fp8Linear`, the module the policy's FP8 layers become;
- `convert`: `to_fp8` (the module swap) and `fp8_update` (once per optimizer step, agreeing
  on amaxes across ranks where asked);
- `report`: `fp8_report`, per-layer scales, amaxes and FP8 error.
"""

from mixprec.fp8.convert import NoFp8LayerError, fp8_layers, fp8_update, to_fp8
from mixprec.fp8.gemm import gemm_choices, set_gemm_path
from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipe import RECIPES, Fp8Recipe
from mixprec.fp8.report import Fp8Report, fp8_report

__all__ = [
    "RECIPES",
    "Fp8Linear",
    "Fp8Recipe",
    "Fp8Report",
    "NoFp8LayerError",
    "fp8_layers",
    "fp8_report",
    "fp8_update",
    "gemm_choices",
    "set_gemm_path",
    "to_fp8",
]
