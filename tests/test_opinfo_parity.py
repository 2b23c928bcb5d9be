"""Beyond torch's autocast lists: every op in torch's OpInfo database and every nn module in its
ModuleInfo database, under torch.autocast and mixprec.autocast.

This is the oracle for what a Python-level engine can get wrong: C++ composites whose inner ops
torch casts (``tensordot`` on CPU calls ``mm``) and Python wrappers whose bodies it must enter.
Inputs come in fp32 (finds missing LOWER rules) and in the low dtype (finds missing FP32 rules).

- CPU: real tensors; output dtypes must match, and values must match bit for bit.
- CUDA: fake CUDA tensors on the CPU, so torch's AutocastCUDA kernels decide the reference
  dtypes; output dtypes must match.

The few documented differences are listed in EXPECTED below with their reason; a test fails if
an op leaves or joins that list, so the list cannot rot.
"""

from __future__ import annotations

import collections
import itertools
import warnings
from typing import Any

import pytest
import torch

import mixprec
from mixprec.policy.decompositions import KNOWN_DEVIATIONS
from tests.conftest import fake_cuda, torch_cuda_autocast
from tests.helpers import dtypes_of as _dtypes

common_methods = pytest.importorskip("torch.testing._internal.common_methods_invocations")
common_modules = pytest.importorskip("torch.testing._internal.common_modules")

pytestmark = pytest.mark.slow

# Ops whose result legitimately differs, with the reason (see policy/decompositions.py).
EXPECTED_DTYPE = {
    ("cpu", "linalg.pinv"): KNOWN_DEVIATIONS["linalg_pinv"],
    ("cpu", "linalg.pinv.hermitian"): KNOWN_DEVIATIONS["linalg_pinv"],
    ("cpu", "tensordot"): KNOWN_DEVIATIONS["tensordot"],
}
EXPECTED_VALUES = {
    # Elementwise work before the first listed op runs on the cast input (dtype matches).
    ("cpu", "cov"): "centres the input before mm",
    ("cpu", "corrcoef"): "centres the input before mm",
}
NONDETERMINISTIC = {
    "empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided",
    "bernoulli", "normal", "uniform", "multinomial",
}  # fmt: skip


def _walk(x: Any, fn) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_walk(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _walk(v, fn) for k, v in x.items()}
    return x


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        if a.is_complex():
            a = torch.view_as_real(a.resolve_conj().to(torch.complex64))
            b = torch.view_as_real(b.resolve_conj().to(torch.complex64))
        if a.is_floating_point():
            return torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return True


def _sweep(device: str, amp: torch.dtype, low_inputs: bool) -> tuple[dict, dict]:
    # Silence (rather than record) the thousands of warnings the samples raise: recording them
    # makes the sweep several times slower.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if device == "cuda":
            with fake_cuda():  # one fake mode for the whole sweep: creating one is slow
                return _sweep_in(device, amp, low_inputs)
        return _sweep_in(device, amp, low_inputs)


def _sweep_in(device: str, amp: torch.dtype, low_inputs: bool) -> tuple[dict, dict]:
    dtype_diff: dict[str, Any] = {}
    value_diff: dict[str, Any] = {}
    for op in common_methods.op_db:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            # The raw generator: OpInfo.sample_inputs wraps it in an iterator that inspects the
            # whole call stack and reseeds for every sample, which is slow under pytest.
            raw = op.sample_inputs_func(op, "cpu", torch.float32, False)
            samples = list(itertools.islice(raw, 3))
        except Exception:
            continue
        for s in samples:
            args, kwargs = (s.input, *s.args), dict(s.kwargs)
            if low_inputs:
                args = _walk(args, lambda t: t.to(amp) if t.dtype == torch.float32 else t)
                kwargs = _walk(kwargs, lambda t: t.to(amp) if t.dtype == torch.float32 else t)
            if device == "cuda":
                if any(t.layout != torch.strided for t in _flat((args, kwargs))):
                    continue
                cast = lambda t: torch.empty_strided(  # noqa: E731
                    t.shape, t.stride(), dtype=t.dtype, device="cuda"
                )
                fargs, fkwargs = _walk(args, cast), _walk(kwargs, cast)
                try:
                    with torch_cuda_autocast(amp):
                        ref = op.op(*fargs, **fkwargs)
                except Exception:
                    continue
                with mixprec.autocast("cuda", dtype=amp):
                    got = op.op(*fargs, **fkwargs)
            else:
                try:
                    with torch.autocast("cpu", dtype=amp):
                        ref = op.op(*args, **kwargs)
                except Exception:
                    continue
                with mixprec.autocast("cpu", dtype=amp):
                    got = op.op(*args, **kwargs)
            if _dtypes(ref) != _dtypes(got):
                dtype_diff[name] = (_dtypes(ref), _dtypes(got))
            elif device == "cpu" and op.name not in NONDETERMINISTIC and not _equal(ref, got):
                value_diff[name] = "values differ"
    return dtype_diff, value_diff


def _flat(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _walk(x, lambda t: out.append(t) or t)
    return out


@pytest.mark.parametrize("device,amp", [("cpu", torch.bfloat16), ("cuda", torch.float16)])
@pytest.mark.parametrize("low_inputs", [False, True], ids=["fp32-inputs", "low-inputs"])
def test_opinfo_sweep(device, amp, low_inputs):
    dtype_diff, value_diff = _sweep(device, amp, low_inputs)
    expected = {n for (d, n) in EXPECTED_DTYPE if d == device}
    unexpected = {n: v for n, v in dtype_diff.items() if n not in expected}
    assert not unexpected, f"dtype differs from torch.autocast: {unexpected}"
    if not low_inputs:  # the documented differences must still be there (no silent drift)
        assert set(dtype_diff) == expected, set(dtype_diff) ^ expected
        exp_values = {n for (d, n) in EXPECTED_VALUES if d == device}
        unexpected_values = set(value_diff) - exp_values
        assert not unexpected_values, f"values differ from torch.autocast: {unexpected_values}"


# Modules whose CPU result differs (recurrent cells computed in mixed precision inside C++).
EXPECTED_MODULES = {
    "GRUCell": KNOWN_DEVIATIONS["gru_cell"],
    "LSTMCell": KNOWN_DEVIATIONS["lstm_cell"],
    "GRU": KNOWN_DEVIATIONS["gru"],
    "LSTM": KNOWN_DEVIATIONS["lstm"],
}


def test_module_sweep_cpu():
    differ: dict[str, Any] = collections.defaultdict(list)
    count = 0
    for info in common_modules.module_db:
        try:
            inputs = info.module_inputs_func(
                info, device="cpu", dtype=torch.float32, requires_grad=False, training=True
            )
        except Exception:
            continue
        for mi in inputs[:3]:
            if mi.forward_input is None:
                continue
            try:
                torch.manual_seed(0)
                module = info.module_cls(*mi.constructor_input.args, **mi.constructor_input.kwargs)
            except Exception:
                continue
            fi = mi.forward_input
            try:
                torch.manual_seed(1)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    ref = module(*fi.args, **fi.kwargs)
            except Exception:
                continue
            torch.manual_seed(1)
            with mixprec.autocast("cpu", dtype=torch.bfloat16):
                got = module(*fi.args, **fi.kwargs)
            count += 1
            if _dtypes(ref) != _dtypes(got) or not _equal(ref, got):
                differ[info.module_cls.__name__].append((_dtypes(ref), _dtypes(got)))
    assert count > 200, "the module database yielded too few samples to mean anything"
    assert set(differ) == set(EXPECTED_MODULES), dict(differ)
