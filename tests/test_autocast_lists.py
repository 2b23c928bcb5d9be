"""Op-for-op parity with torch.autocast on torch's own autocast test lists.

torch.testing._internal.autocast_test_lists is the table torch tests its C++ autocast against.
Every entry runs under torch.autocast and under mixprec.autocast; outputs must have the same
dtype and the same values, bit for bit, for the torch.* and the Tensor.* variant, in bf16 and
fp16. The CUDA lists run three ways: on a real GPU when there is one; on the CPU with fake CUDA
tensors, where torch's AutocastCUDA kernels still propagate dtypes; and with mixprec's CUDA table
applied to real CPU tensors, compared value by value to a control that casts the inputs by hand
(torch's own test method).
"""

from __future__ import annotations

import collections.abc
from collections.abc import Callable
from typing import Any

import pytest
import torch

import mixprec
from tests.conftest import HAS_CUDA, fake_cuda, requires_cuda, torch_cuda_autocast
from tests.helpers import dtypes_of as _dtypes

lists = pytest.importorskip("torch.testing._internal.autocast_test_lists")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, str):
        return value
    if isinstance(value, collections.abc.Iterable):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _half_to(value: Any, dtype: torch.dtype) -> Any:
    """Replace fp16 tensors by `dtype` ones (the bf16 analogue of a list written for fp16)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype == FP16 else value
    if isinstance(value, (list, tuple)):
        return type(value)(_half_to(v, dtype) for v in value)
    return value


def _fake_limitation(err: BaseException) -> bool:
    """Errors that come from running CUDA kernels as fakes on a CPU-only build."""
    text = str(err)
    return (
        isinstance(err, NotImplementedError)
        or type(err).__name__ == "DataDependentOutputException"
        or any(s in text for s in ("CUDA", "cuda devices", "Meta tensors", "NVIDIA driver"))
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _variants(op: str, args: tuple, kwargs: dict, module: Any) -> list[Callable[[], Any]]:
    calls = []
    if module is not None and hasattr(module, op):
        calls.append(lambda: getattr(module, op)(*args, **kwargs))
    if hasattr(torch.Tensor, op):
        calls.append(lambda: getattr(args[0], op)(*args[1:], **kwargs))
    assert calls, f"{op} is neither on {module} nor on Tensor"
    return calls


def _check(op, args, expected, amp, module=torch, kwargs=None, device="cpu"):
    """torch.autocast and mixprec.autocast agree bitwise, and produce the expected dtype."""
    kwargs = kwargs or {}
    for call in _variants(op, args, kwargs, module):
        with torch.autocast(device, dtype=amp):
            ref = call()
        with mixprec.autocast(device, dtype=amp):
            got = call()
        assert _same(ref, got), f"{op} ({amp}): mixprec {_dtypes(got)} vs torch {_dtypes(ref)}"
        if isinstance(got, torch.Tensor) and expected is not None:
            assert got.dtype == expected, f"{op} ({amp}): {got.dtype}, expected {expected}"


# ----------------------------------------------------------------------------- CPU, real tensors

CPU = lists.AutocastCPUTestLists(torch.device("cpu"))


def _kw(entry):
    return entry[2] if len(entry) > 2 else {}


@pytest.mark.parametrize("entry", CPU.torch_16, ids=lambda e: e[0])
@pytest.mark.parametrize("amp", [BF16, FP16], ids=["bf16", "fp16"])
def test_cpu_torch_16(entry, amp):
    _check(entry[0], entry[1], amp, amp, kwargs=_kw(entry))


@pytest.mark.parametrize("entry", CPU.nn_16, ids=lambda e: e[0])
@pytest.mark.parametrize("amp", [BF16, FP16], ids=["bf16", "fp16"])
def test_cpu_nn_16(entry, amp):
    _check(entry[0], entry[1], amp, amp, module=torch._C._nn, kwargs=_kw(entry))


@pytest.mark.parametrize("entry", CPU.torch_fp32, ids=lambda e: e[0])
@pytest.mark.parametrize("amp", [BF16, FP16], ids=["bf16", "fp16"])
def test_cpu_torch_fp32(entry, amp):
    _check(entry[0], _cast(entry[1], amp), FP32, amp, kwargs=_kw(entry))


@pytest.mark.parametrize("entry", CPU.nn_fp32, ids=lambda e: e[0])
@pytest.mark.parametrize("amp", [BF16, FP16], ids=["bf16", "fp16"])
def test_cpu_nn_fp32(entry, amp):
    _check(entry[0], _cast(entry[1], amp), FP32, amp, module=torch._C._nn,
               kwargs=_kw(entry))  # fmt: skip


@pytest.mark.parametrize("entry", CPU.torch_need_autocast_promote, ids=lambda e: e[0])
def test_cpu_need_autocast_promote(entry):
    op, args_bf16, args_fp16 = entry
    _check(op, args_bf16, FP32, BF16)
    _check(op, args_fp16, FP32, FP16)


@pytest.mark.parametrize(
    "entry",
    CPU.torch_expect_builtin_promote + CPU.methods_expect_builtin_promote,
    ids=lambda e: e[0],
)
def test_cpu_builtin_promote(entry):
    op, args_bf16, args_fp16, out_type = entry
    module = torch if not op.startswith("__") else None
    _check(op, args_bf16, out_type, BF16, module=module)
    _check(op, args_fp16, out_type, FP16, module=module)


# -------------------------------------------------------- CUDA lists: expected category per list

# (list name, module, expected output dtype: 'amp' = the region's low dtype, or a dtype)
_CUDA_LISTS = [
    ("torch_fp16", torch, "amp"),
    ("torch_fp32", torch, FP32),
    ("torch_need_autocast_promote", torch, FP32),
    ("nn_fp16", torch._C._nn, "amp"),
    ("nn_fp32", torch._C._nn, FP32),
    ("linalg_fp16", torch._C._linalg, "amp"),
    ("methods_fp16", None, "amp"),
    ("methods_fp32", None, FP32),
    ("torch_expect_builtin_promote", torch, None),
    ("methods_expect_builtin_promote", None, None),
]


def _cuda_cases(device: str) -> list:
    table = lists.AutocastTestLists(torch.device(device))
    cases = []
    for name, module, expected in _CUDA_LISTS:
        for entry in getattr(table, name):
            op, args = entry[0], entry[1]
            if isinstance(args, str):
                # torch's list writes einsum as (op, equation, operands), a shape its own test
                # skips by accident (the operands land in the skip flag, and the 4-d equation
                # does not fit the 2-d operands). Run it as a valid matmul-style einsum.
                args = ("ij,jk->ik", *entry[2])
                entry = (op, args)
            want = entry[2] if name.endswith("expect_builtin_promote") else expected
            if len(entry) > 2 and isinstance(entry[2], bool) and entry[2]:
                continue  # the list's own skip flag (ROCm)
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            module_ = None if op.startswith("__") else module
            cases.append(pytest.param(op, args, kwargs, module_, want, id=f"{name}:{op}"))
    return cases


def _to_fake_cuda(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda")
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_fake_cuda(v) for v in value)
    return value


CPU_TENSOR_CASES = _cuda_cases("cpu")


@pytest.mark.parametrize("op,args,kwargs,module,want", CPU_TENSOR_CASES)
@pytest.mark.parametrize("amp", [FP16, BF16], ids=["fp16", "bf16"])
def test_cuda_lists_dtypes_on_fake_cuda(op, args, kwargs, module, want, amp):
    """torch's AutocastCUDA kernels vs mixprec's CUDA table, on fake CUDA tensors (no GPU)."""
    if op in ("cudnn_convolution", "cudnn_convolution_transpose"):
        pytest.skip("cuDNN ops have no fake kernel on a CPU-only build")
    with fake_cuda():
        args = _to_fake_cuda(_half_to(args, amp))
        for call in _variants(op, args, kwargs, module):
            with torch_cuda_autocast(amp):
                try:
                    ref = call()
                except Exception as err:
                    if _fake_limitation(err):
                        pytest.skip(f"fake CUDA cannot run {op}: {str(err)[:80]}")
                    raise
            with mixprec.autocast("cuda", dtype=amp):
                try:
                    got = call()
                except Exception as err:
                    if _fake_limitation(err):
                        pytest.skip(f"fake CUDA cannot run {op}: {str(err)[:80]}")
                    raise
            assert _dtypes(got) == _dtypes(ref), f"{op}: {_dtypes(got)} vs torch {_dtypes(ref)}"
            expected = amp if want == "amp" else want
            if isinstance(got, torch.Tensor) and expected is not None:
                assert got.dtype == expected


@pytest.mark.parametrize("op,args,kwargs,module,want", CPU_TENSOR_CASES)
def test_cuda_table_values_on_cpu(op, args, kwargs, module, want):
    """The CUDA table on CPU tensors equals the hand-cast control (torch's own test method)."""
    if want not in ("amp", FP32) or op.startswith("cudnn"):
        pytest.skip("no hand-cast control for builtin-promote or cuDNN-only entries")
    amp = FP16
    run_as = amp if want == "amp" else want
    policy = mixprec.Policy(table="cuda")
    for call_on in _variants(op, args, kwargs, module)[:1]:
        with mixprec.autocast("cpu", dtype=amp, policy=policy):
            got = call_on()
        if module is not None and hasattr(module, op):
            control = getattr(module, op)(*_cast(args, run_as), **kwargs)
        else:
            control = getattr(_cast(args[0], run_as), op)(*_cast(args[1:], run_as), **kwargs)
        assert _same(got, control), f"{op}: {_dtypes(got)} vs control {_dtypes(control)}"


def test_cuda_banned_binary_cross_entropy_fake():
    with fake_cuda():
        a = torch.rand(4, 4, device="cuda")
        b = torch.rand(4, 4, device="cuda")
        with torch_cuda_autocast(FP16), pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch._C._nn.binary_cross_entropy(a, b)
        with mixprec.autocast("cuda"), pytest.raises(mixprec.BannedOpError) as err:
            torch.nn.functional.binary_cross_entropy(a, b)
    msg = str(err.value)
    assert "binary_cross_entropy_with_logits" in msg and "move('binary_cross_entropy'" in msg


# ------------------------------------------------------------------------- CUDA, real tensors


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    "op,args,kwargs,module,want", _cuda_cases("cuda") if HAS_CUDA else [], ids=str
)
@pytest.mark.parametrize("amp", [FP16, BF16], ids=["fp16", "bf16"])
def test_cuda_lists_on_gpu(op, args, kwargs, module, want, amp):
    if amp == BF16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    expected = amp if want == "amp" else want
    # _check compares torch's result with mixprec's bit for bit: cuDNN must not pick a
    # nondeterministic (split-reduction) convolution algorithm for one run and not the other,
    # so these run deterministic, as torch's own CUDA autocast tests do.
    with torch.backends.cudnn.flags(enabled=True, deterministic=True):
        _check(op, _half_to(args, amp), expected, amp, module, kwargs, device="cuda")


@pytest.mark.parametrize("name", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_cuda_rnn_composites_are_left_to_torchs_dispatcher(name):
    """On CUDA, torch casts cuDNN's flat RNN weight buffer inside ``_cudnn_rnn``; a cast of the
    outer call would split it (the GPU test below). So the CUDA table has no rule for the RNN
    composites while the policy agrees with torch's list; the CPU table keeps its rule, and an
    edit that disagrees gets a rule back (guarded, so torch's dispatcher stays out)."""
    from mixprec.eager.mode import _handle
    from mixprec.eager.rules import Guarded
    from mixprec.eager.table import tables
    from mixprec.policy.policy import DEFAULT_POLICY

    fn = getattr(torch, name)

    def rule(*regions):
        return tables()[_handle(tuple(regions))].memo.get(fn, "absent")

    assert rule(("cuda", FP16, DEFAULT_POLICY)) is None
    assert rule(("cuda", BF16, DEFAULT_POLICY)) is None
    assert rule(("cpu", BF16, DEFAULT_POLICY)) not in (None, "absent")
    edited = mixprec.Policy().move("_cudnn_rnn", to="fp32")
    moved = rule(("cuda", FP16, edited))
    assert isinstance(moved, Guarded) and moved.category is mixprec.OpCategory.FP32
    assert "torch's dispatcher" in mixprec.Policy().decide(name, device_type="cuda").reason
    assert "torch's dispatcher" not in mixprec.Policy().decide(name, device_type="cpu").reason


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_cuda_rnn_matches_torch_and_keeps_cudnns_flat_weights(cell):
    """torch.autocast casts an RNN's weights inside cuDNN's kernel, as one flat buffer. mixprec
    must give the same result without breaking that layout: cast one by one from Python (as
    mixprec did until the first GPU run failed this test), cuDNN copies the weights into one
    buffer on every call, warning 'RNN module weights are not part of single contiguous chunk
    of memory'."""
    import warnings

    torch.manual_seed(0)
    rnn = getattr(torch.nn, cell)(32, 64, num_layers=2).cuda()
    x = torch.randn(5, 3, 32, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mixprec.autocast("cuda"):
            out = rnn(x)[0]
    with torch.autocast("cuda"):
        ref = rnn(x)[0]
    assert out.dtype == ref.dtype == torch.float16
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    assert not [w for w in caught if "contiguous chunk" in str(w.message)], caught
