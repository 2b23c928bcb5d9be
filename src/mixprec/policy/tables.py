"""Base op tables: which category each op is in, per device type. Data only.

The ``torch`` lists mirror the kernels torch.autocast registers in its dispatcher (torch 2.13,
``aten/src/ATen/autocast_mode.{h,cpp}``), so that mixprec.autocast reproduces torch.autocast op for
op. Names are aten op names without overloads; one name covers every Python entry point of the op
(``torch.mm``, ``Tensor.mm``, ``Tensor.__matmul__`` -> ``matmul``, ``F.linear``, ...).

torch.autocast sees ops *inside* C++ composite functions, because it sits in the dispatcher. A
Python-level engine sees only the outer call of a C++ composite, so the ``COMPOSITE_*`` lists give
such outer calls the category that reproduces torch's result (e.g. ``tensordot`` on CPU is lowered
because its C++ body calls ``mm``). A test asserts that every op torch registers is listed here
(``torch._C._dispatch_has_kernel_for_dispatch_key``) and nothing more (``RELEASE_DEPENDENT``
entries follow the running torch), and a sweep over torch's OpInfo database
finds the composites.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from mixprec.policy.categories import OpCategory

__all__ = ["TABLES", "VERSIONED", "OpTable"]

L, F32, OUT, PRO, BAN = (
    OpCategory.LOWER,
    OpCategory.FP32,
    OpCategory.FP32_OUTPUT,
    OpCategory.PROMOTE,
    OpCategory.BANNED,
)


@dataclass(frozen=True)
class OpTable:
    """A named base table: op name -> category, with the source of each entry.

    Attributes:
        name: the table's name (``'cuda'``, ``'cpu'``, ...), as used by ``Policy(table=...)``.
        description: where the entries come from.
        ops: op name -> category.
        sources: op name -> a short phrase saying why the op is listed.
    """

    name: str
    description: str
    ops: Mapping[str, OpCategory]
    sources: Mapping[str, str] = field(default_factory=dict)

    def names(self, category: OpCategory) -> frozenset[str]:
        """The op names this table puts in `category`."""
        return frozenset(n for n, c in self.ops.items() if c is category)


#: Registered entries that torch.autocast gained after the oldest release mixprec supports: each
#: is listed only where the running torch registers the autocast kernel (checked once, at import),
#: so that mixprec matches the torch it runs on, release by release.
RELEASE_DEPENDENT: Mapping[str, str] = MappingProxyType({
    "rms_norm": "CUDA and XPU since a release after 2.11; 2.11 runs it in the input dtype",
})  # fmt: skip


def _autocasts(op: str, device_type: str) -> bool:
    """Whether this torch registers an autocast kernel for `op` on `device_type`."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(
            f"aten::{op}", f"Autocast{device_type.upper()}"
        )
    except RuntimeError:  # the op itself does not exist in this release
        return False


def _table(
    name: str,
    description: str,
    registered: Mapping[OpCategory, Iterable[str]],
    composites: Mapping[OpCategory, Iterable[str]] = MappingProxyType({}),
) -> OpTable:
    ops: dict[str, OpCategory] = {}
    sources: dict[str, str] = {}
    for cat, names in registered.items():
        for n in names:
            if n in RELEASE_DEPENDENT and not _autocasts(n, name):
                continue  # this torch's autocast leaves the op alone: so does mixprec
            ops[n] = cat
            sources[n] = f"torch.autocast's {name.upper()} {cat.value} list"
            if n in RELEASE_DEPENDENT:
                sources[n] += f" ({RELEASE_DEPENDENT[n]})"
    for cat, names in composites.items():
        for n in names:
            ops[n] = cat
            sources[n] = (
                f"C++ composite whose inner ops torch.autocast casts on {name.upper()}; "
                f"{cat.value} reproduces its result"
            )
    return OpTable(name, description, MappingProxyType(ops), MappingProxyType(sources))


# --- CUDA / XPU: AT_FORALL_* lists in autocast_mode.h (the same list serves fp16 and bf16) ---

_GPU_LOWER = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # fmt: skip

_GPU_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "rms_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "linalg_matrix_sqrth", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip

# fp32_set_opt_dtype and fp32_append_dtype (norm) in torch: both pass dtype=float32 to the op.
_GPU_FP32_OUTPUT = (
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum", "norm",
)  # fmt: skip

_GPU_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)  # fmt: skip

_CUDA = _table(
    "cuda",
    "torch.autocast's CUDA lists (fp16 and bf16 share them)",
    {
        # _cudnn_rnn is registered in aten/src/ATen/cudnn/AutocastRNN.cpp (CUDA builds only):
        # nn.LSTM/GRU/RNN on CUDA run in the low dtype through it.
        L: (*_GPU_LOWER, "cudnn_convolution", "cudnn_convolution_transpose", "_cudnn_rnn"),
        F32: _GPU_FP32,
        OUT: _GPU_FP32_OUTPUT,
        PRO: _GPU_PROMOTE,
        BAN: ("binary_cross_entropy",),
    },
)

_XPU = _table(
    "xpu",
    "torch.autocast's XPU lists (the CUDA lists without the cuDNN-only ops)",
    {L: _GPU_LOWER, F32: _GPU_FP32, OUT: _GPU_FP32_OUTPUT, PRO: _GPU_PROMOTE,
     BAN: ("binary_cross_entropy",)},
)  # fmt: skip

# --- CPU: the AutocastCPU block in autocast_mode.cpp (bf16 or fp16) ---

_CPU = _table(
    "cpu",
    "torch.autocast's CPU lists (bf16 and fp16 share them)",
    {
        L: (
            "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
            "_addmm_activation", "addbmm", "linear", "_convolution", "matmul", "conv_tbc",
            "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
            "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
        ),
        F32: (
            "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "quantile",
            "nanquantile", "stft", "cdist", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback",
            "grid_sampler_3d", "trace", "view_as_complex", "cholesky", "cholesky_inverse",
            "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d",
            "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d",
            "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d",
            "mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
            "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss", "cross_entropy_loss",
            "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
            "triplet_margin_loss", "multi_margin_loss", "ctc_loss", "kl_div",
            "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft",
            "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft",
            "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft",
            "linalg_cond", "linalg_matrix_rank", "linalg_solve", "linalg_cholesky",
            "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
            "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve",
            "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd",
            "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d",
            "adaptive_max_pool3d", "multilabel_margin_loss_forward", "linalg_qr",
            "linalg_cholesky_ex", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq",
            "linalg_inv_ex", "linalg_matrix_sqrth",
        ),
        PRO: ("stack", "cat", "index_copy"),
    },
)  # fmt: skip

# --- MPS: the AutocastMPS block in autocast_mode.cpp ---

_MPS = _table(
    "mps",
    "torch.autocast's MPS lists",
    {
        L: (
            "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
            "conv_transpose2d", "conv_transpose3d", "convolution", "_mps_convolution", "prelu",
            "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linear", "addbmm",
            "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "lstm_cell",
            "scaled_dot_product_attention",
        ),
        F32: (
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
            "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm",
            "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm", "batch_norm",
            "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
            "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
            "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
            "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
            "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        ),
        OUT: (
            "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
            "linalg_matrix_norm", "sum",
        ),
        PRO: (
            "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler",
            "index_put", "tensordot", "scatter_add",
        ),
    },
)  # fmt: skip

#: Entries that only some supported torch releases have: the tables serve torch 2.11 through
#: 2.14+, so an op a release added or removed is listed, and matches nothing where it is absent.
VERSIONED: Mapping[str, str] = MappingProxyType({
    "linalg_matrix_sqrth": "added to torch's CUDA and CPU fp32 lists in torch 2.14",
    "cholesky": "deprecated op, removed in torch 2.14 (torch.linalg.cholesky remains)",
    "qr": "deprecated op, removed in torch 2.14 (torch.linalg.qr remains)",
})  # fmt: skip

#: Base tables by name. ``Policy(table=None)`` uses the table named after the region's device.
TABLES: Mapping[str, OpTable] = MappingProxyType({t.name: t for t in (_CUDA, _CPU, _XPU, _MPS)})
