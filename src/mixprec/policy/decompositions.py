"""C++ composite ops: which listed ops their bodies call, so the outer call inherits a category.

torch.autocast sits in the dispatcher and casts the ops a C++ composite calls internally: on CPU,
``torch.tensordot`` computes in bf16 because its body calls ``mm``. mixprec sees only the outer
call of a C++ function, so a composite that no table lists takes the category of the first op in
its ``via`` list that the region's table lists (a table entry for the composite itself wins, as
in the dispatcher). Editing the inner op (``Policy.move('mm', ...)``) therefore moves the
composite with it.

``via`` lists were read off torch 2.13 (a dispatch-mode trace of each composite) and are checked
by the OpInfo sweep in the test suite. Where the composite does elementwise work *before* its
first listed op (``cov`` centres its input, ``pairwise_distance`` subtracts), mixprec's result has
torch's dtype but is computed from the cast input, so values may differ in the last bits.

Some composites mix precisions in a way no cast of the outer call reproduces; they are left
in their input dtype and listed in `KNOWN_DEVIATIONS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["COMPOSITES", "KNOWN_DEVIATIONS", "Via"]


@dataclass(frozen=True)
class Via:
    """How a C++ composite reaches the ops torch.autocast lists.

    Attributes:
        ops: the listed ops its body calls first, in order; the first one the region's table
            lists decides the category. FP32_OUTPUT becomes FP32 (cast the input) unless
            `accepts_dtype`.
        accepts_dtype: the composite takes ``dtype=`` itself, so FP32_OUTPUT can stay.
        keep: argument positions and names that must not be cast.
        restore: cast the result back to the first input's dtype (the composite accumulates
            the inner op's low-precision results into a buffer of its input dtype, as
            ``_trilinear`` does on CPU).
        resolve: for composites whose inner op depends on the arguments (``pad``'s mode): a
            function of ``(args, kwargs)`` returning the inner op's name, or None (no listed
            op: the call runs in its input dtype). On the device types in `dispatcher`, `ops`
            decides instead.
        decompose: for composites that mix precisions in a way no cast of the outer call
            reproduces: a Python re-statement of the C++ body, run under the region so each of
            its ops gets the policy (``bilinear`` on CPU: ``_trilinear`` in bf16, then ``+ bias``
            in fp32).
        dispatcher: device types on which the whole call is left to torch's dispatcher while
            the policy treats the composite as torch's list does: there the inner kernel casts
            what a cast of the outer call would break. cuDNN's RNN weights are one flat buffer
            that torch casts inside ``_cudnn_rnn``; cast one by one from Python, they stop
            being one buffer, and cuDNN copies them into one (and warns) on every call.
    """

    ops: tuple[str, ...] = ()
    accepts_dtype: bool = False
    keep: tuple[int | str, ...] = ()
    restore: bool = False
    resolve: Callable[[tuple[Any, ...], Mapping[str, Any]], str | None] | None = None
    decompose: Callable[..., Any] | None = None
    dispatcher: tuple[str, ...] = ()


def _pad_inner(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    # at::pad dispatches on mode and on how many dimensions are padded.
    pad = args[1] if len(args) > 1 else kwargs.get("pad", ())
    mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
    dims = len(pad) // 2
    if mode == "reflect":
        return f"reflection_pad{dims}d"
    if mode == "replicate":
        return f"replication_pad{dims}d"
    if mode == "circular":
        return "_pad_circular"
    return "constant_pad_nd"


def _einsum_inner(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    # at::einsum contracts operand pairs with bmm only when a label is summed away; outer
    # products and single-operand reductions use mul/sum.
    if not args or not isinstance(args[0], str):
        return None
    equation = args[0].replace(" ", "")
    operands = args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(operands) < 2:
        return None
    lhs, _, out = equation.partition("->")
    terms = lhs.split(",")
    if "->" not in equation:  # implicit output: labels that appear exactly once, sorted
        counts = {c: lhs.count(c) for c in set(lhs) if c.isalpha()}
        out = "".join(sorted(c for c, n in counts.items() if n == 1))
    summed = {c for term in terms for c in term if c.isalpha() and c not in out}
    shared = {c for c in summed if sum(c in term for term in terms) >= 2}
    return "bmm" if shared else None


def _matrix_power_inner(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    n = args[1] if len(args) > 1 else kwargs.get("n", 1)
    # n >= 2 multiplies (mm); 0 and 1 copy; negative powers invert first (fp32 on CPU), which
    # no outer cast reproduces.
    return "mm" if isinstance(n, int) and n >= 2 else None


def _lstm_inner(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    # at::lstm (aten/src/ATen/native/RNN.cpp) takes oneDNN's kernel, which torch.autocast
    # lowers (mkldnn_rnn_layer), only where use_mkldnn(input, params, hx) holds and the LSTM has
    # no projections; the packed-sequence overload lstm(data, batch_sizes, hx, ...) never does.
    # Elsewhere it runs its native cells, whose gate matmuls torch casts inside the kernel
    # and whose state update stays fp32 (a KNOWN_DEVIATION: mixprec runs them in the input
    # dtype). CUDA never asks: there the call
    # is left to the dispatcher (`Via.dispatcher`).
    import torch

    input = args[0] if args else kwargs.get("input", kwargs.get("data"))
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    params = args[2] if len(args) > 2 else kwargs.get("params", ())
    if not isinstance(input, torch.Tensor) or not isinstance(hx, (list, tuple)) or len(hx) != 2:
        return None  # the packed overload (its second argument is the batch_sizes tensor)
    if not torch.backends.mkldnn.is_available() or not torch._C._get_mkldnn_enabled():
        return None
    for t in (input, *hx, *params):
        # Backend::CPU: a dense, non-quantized CPU tensor.
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return None
        if t.layout is not torch.strided or t.is_quantized:
            return None
    dtype = input.dtype
    supported = (
        dtype is torch.float32
        or (dtype is torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        or (
            dtype is torch.float16
            and not torch.is_grad_enabled()
            and torch.ops.mkldnn._is_mkldnn_fp16_supported()
        )
    )
    if not supported or input.numel() == 0:
        return None
    if hx[0].shape[-1] != hx[1].shape[-1]:
        # Projections (proj_size > 0): oneDNN has none, and torch's native cells end each step
        # on a lowered at::matmul (h = w_hr @ ...), so the output is low; lowered as a whole.
        return "matmul"
    return "mkldnn_rnn_layer"


def _bilinear(input1: Any, input2: Any, weight: Any, bias: Any = None) -> Any:
    # The body of at::bilinear (aten/src/ATen/native/Linear.cpp).
    import torch

    out = torch._trilinear(
        input1.reshape(-1, input1.shape[-1]),
        weight,
        input2.reshape(-1, input2.shape[-1]),
        [1, 3], [0], [1, 2], [2, 3],
    ).reshape(*input1.shape[:-1], weight.shape[0])  # fmt: skip
    return out if bias is None else out + bias


COMPOSITES: Mapping[str, Via] = MappingProxyType(
    {
        # matmul family: permute/reshape, then a listed matmul
        "tensordot": Via(("mm",)),
        "einsum": Via(resolve=_einsum_inner),
        "linalg_multi_dot": Via(("mm",)),
        "chain_matmul": Via(("mm",)),
        "linalg_matrix_power": Via(resolve=_matrix_power_inner),
        "cov": Via(("mm",)),
        "corrcoef": Via(("mm",)),
        "_trilinear": Via(("bmm",), restore=True),
        "bilinear": Via(decompose=_bilinear),
        # losses and reductions
        "cross_entropy_loss": Via(("log_softmax", "nll_loss")),
        "nll_loss_nd": Via(("nll_loss", "nll_loss2d")),
        "square": Via(("pow",)),
        "sum_to_size": Via(("sum",)),
        "trapezoid": Via(("sum",)),
        "trapz": Via(("sum",)),
        "cumulative_trapezoid": Via(("cumsum",)),
        "linalg_norm": Via(("linalg_vector_norm", "linalg_matrix_norm"), accepts_dtype=True),
        "pairwise_distance": Via(("norm",)),
        "pad": Via(resolve=_pad_inner),
        # recurrent layers: cuDNN on CUDA (torch autocasts _cudnn_rnn), oneDNN or addmm on CPU
        "lstm": Via(("_cudnn_rnn",), resolve=_lstm_inner, dispatcher=("cuda",)),
        "gru": Via(("_cudnn_rnn",), dispatcher=("cuda",)),
        "rnn_tanh": Via(("_cudnn_rnn", "addmm"), dispatcher=("cuda",)),
        "rnn_relu": Via(("_cudnn_rnn", "addmm"), dispatcher=("cuda",)),
        "rnn_tanh_cell": Via(("linear",)),
        "rnn_relu_cell": Via(("linear",)),
    }
)

#: Composites torch.autocast computes in mixed precision *inside* one C++ kernel, which a cast
#: of the outer call cannot reproduce: mixprec runs them in their input dtype (fp32 for fp32
#: inputs), so the result dtype matches torch and the values come from a more precise
#: computation.
KNOWN_DEVIATIONS: Mapping[str, str] = MappingProxyType(
    {
        "gru": "CPU: gates from bf16 addmm, hidden-state update in fp32 against an fp32 hx",
        "gru_cell": "CPU: gates from bf16 addmm, hidden-state update in fp32 against an fp32 hx",
        "lstm_cell": "CPU: gates from bf16 linear, cell-state update in fp32 against an fp32 cx",
        "linalg_pinv": "CPU: svd in fp32 (listed), final matmul in bf16",
        "linalg_matrix_power": "negative powers: inverse in fp32 (CPU list), then mm in bf16",
        "lstm": (
            "CPU: oneDNN returns the final cell state c_n in fp32 (mixprec's is bf16); without "
            "oneDNN (packed sequences, mkldnn disabled) torch's gates come from bf16 matmuls and "
            "the state update is fp32, mixprec's are fp32"
        ),
        "tensordot": "degenerate shapes (size-1 contractions) skip torch's mm; mixprec lowers",
    }
)
