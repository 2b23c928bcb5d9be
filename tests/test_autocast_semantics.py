"""Region semantics: nesting, exceptions, threads, eligibility, in-place/out=, the weight-cast
cache (counted with a dispatch mode), backward dtypes, the decorator form and every error."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.eager.mode import find_mode
from tests.helpers import CastCounter

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _stack_len() -> int:
    return torch._C._len_torch_function_stack()


# ------------------------------------------------------------------------------ nesting / state


def test_nesting_restores_state_on_exit():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with mixprec.autocast("cpu"):
        assert torch.mm(a, b).dtype == BF16
        with mixprec.autocast("cpu", enabled=False):
            assert torch.mm(a, b).dtype == FP32
            assert not mixprec.is_autocast_enabled("cpu")
            with mixprec.autocast("cpu", dtype=FP16):
                assert torch.mm(a, b).dtype == FP16
                assert mixprec.get_autocast_dtype("cpu") == FP16
            assert torch.mm(a, b).dtype == FP32
        assert torch.mm(a, b).dtype == BF16
        assert mixprec.get_autocast_dtype("cpu") == BF16
    assert torch.mm(a, b).dtype == FP32
    assert not mixprec.is_autocast_enabled()
    assert _stack_len() == 0


def test_nested_policy_applies_only_inside():
    x = torch.randn(4, 4)
    fp32_softmax = mixprec.Policy().move("softmax", to="fp32")
    with mixprec.autocast("cpu"):
        assert torch.softmax(x.bfloat16(), 0).dtype == BF16  # CPU list: no softmax rule
        with mixprec.autocast("cpu", policy=fp32_softmax):
            assert torch.softmax(x.bfloat16(), 0).dtype == FP32
            assert mixprec.get_autocast_policy("cpu") is fp32_softmax
        assert torch.softmax(x.bfloat16(), 0).dtype == BF16


def test_exception_inside_region_restores_everything():
    a = torch.randn(4, 4)
    with pytest.raises(ValueError), mixprec.autocast("cpu"), mixprec.autocast("cpu", enabled=False):
        raise ValueError("boom")
    assert _stack_len() == 0
    assert not mixprec.is_autocast_enabled()
    assert torch.mm(a, a).dtype == FP32
    with mixprec.autocast("cpu"):
        with pytest.raises(ValueError), mixprec.autocast("cpu", enabled=False):
            raise ValueError("inner")
        assert torch.mm(a, a).dtype == BF16  # the outer region is intact


def test_disabled_outermost_region_is_a_true_no_op():
    with mixprec.autocast("cpu", enabled=False):
        assert _stack_len() == 0  # no mode pushed: zero dispatch cost
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == FP32


def test_state_is_per_thread():
    results: dict[str, object] = {}
    inside = threading.Event()
    release = threading.Event()

    def other() -> None:
        inside.wait()
        results["enabled"] = mixprec.is_autocast_enabled("cpu")
        results["dtype"] = torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype
        with mixprec.autocast("cpu", dtype=FP16):
            results["own"] = torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype
        release.set()

    t = threading.Thread(target=other)
    t.start()
    with mixprec.autocast("cpu"):
        inside.set()
        release.wait(10)
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == BF16
    t.join()
    assert results == {"enabled": False, "dtype": FP32, "own": FP16}


def test_two_device_types_at_once():
    with mixprec.autocast("cpu"), mixprec.autocast("cuda", enabled=False):
        assert mixprec.is_autocast_enabled("cpu") and not mixprec.is_autocast_enabled("cuda")
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == BF16


def test_decorator_form():
    @mixprec.autocast("cpu")
    def f(a, b):
        return torch.mm(a, b), mixprec.is_autocast_enabled("cpu")

    out, enabled = f(torch.randn(2, 2), torch.randn(2, 2))
    assert out.dtype == BF16 and enabled
    assert not mixprec.is_autocast_enabled()
    assert f.__name__ == "f"


# -------------------------------------------------------------------------------- eligibility


def test_fp64_integer_and_other_device_tensors_are_untouched():
    d = torch.randn(3, 3, dtype=torch.float64)
    i = torch.randint(0, 5, (3, 3))
    with mixprec.autocast("cpu"):
        assert torch.mm(d, d).dtype == torch.float64
        assert torch.mm(i, i).dtype == torch.int64
        assert torch.exp(i).dtype == FP32  # fp32 rule: ints are not cast; exp promotes itself
        assert torch.sum(i).dtype == torch.int64  # fp32_output only for floating inputs
    meta = torch.empty(3, 3, device="meta")
    with mixprec.autocast("cpu"):
        assert torch.mm(meta, meta).dtype == FP32  # a CPU region leaves other devices alone


def test_in_place_and_out_calls_are_not_cast():
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    a0 = a.clone()
    c = torch.zeros(3, 3)
    counter = CastCounter()
    with counter, mixprec.autocast("cpu"):
        torch.mm(a, b, out=c)
        a.addmm_(b, b)
    assert not counter.casts
    assert torch.equal(c, torch.mm(a0, b))  # computed in fp32, bit for bit
    assert a.dtype == FP32 and torch.equal(a, a0.addmm(b, b))


def test_explicit_dtype_argument_is_respected():
    x = torch.randn(4, 4, dtype=FP16)
    with mixprec.autocast("cpu", policy=mixprec.Policy(table="cuda")):
        assert torch.softmax(x, 0).dtype == FP32
        assert torch.softmax(x, 0, dtype=torch.float64).dtype == torch.float64
        assert torch.sum(x, dtype=FP16).dtype == FP16


def test_lists_of_tensors_are_cast():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with mixprec.autocast("cpu"):
        assert torch.linalg.multi_dot([a, b, a]).dtype == BF16
        assert torch.cat([a.bfloat16(), b]).dtype == FP32  # promote: an fp32 input wins
        assert torch.cat([a.bfloat16(), b.bfloat16()]).dtype == BF16


def test_promote_mixing_fp16_and_bf16_goes_to_fp32():
    # torch raises "Unexpected floating ScalarType" here; fp32 holds both exactly.
    with mixprec.autocast("cpu"):
        out = torch.stack([torch.randn(2, dtype=BF16), torch.randn(2, dtype=FP16)])
    assert out.dtype == FP32


# ---------------------------------------------------------------------------- weight-cast cache


def test_weight_is_cast_once_per_region():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    counter = CastCounter()
    with counter, mixprec.autocast("cpu"):
        for _ in range(3):
            lin(x)
    # weight and bias once each; the input three times
    assert counter.casts[(FP32, BF16)] == 2 + 3
    counter = CastCounter()
    with counter:
        for _ in range(2):
            with mixprec.autocast("cpu"):
                lin(x)
    assert counter.casts[(FP32, BF16)] == 2 * 3  # a new region casts again


def test_cache_disabled_casts_every_use():
    lin = torch.nn.Linear(8, 8)
    counter = CastCounter()
    with counter, mixprec.autocast("cpu", cache_enabled=False):
        for _ in range(3):
            lin(torch.randn(2, 8))
    assert counter.casts[(FP32, BF16)] == 3 * 3


def test_no_grad_casts_are_not_cached():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    with mixprec.autocast("cpu"):
        with torch.no_grad():
            torch.mm(x, w)
        y = torch.mm(x, w)
    assert y.requires_grad  # a cast cached under no_grad would have cut the graph here
    y.float().sum().backward()
    assert w.grad is not None


def test_weight_updated_inside_region_is_recast():
    w = torch.nn.Parameter(torch.ones(2, 2))
    x = torch.ones(1, 2)
    with mixprec.autocast("cpu"):
        before = torch.mm(x, w)
        with torch.no_grad():
            w.add_(1.0)
        after = torch.mm(x, w)
    assert before.tolist() == [[2.0, 2.0]] and after.tolist() == [[4.0, 4.0]]


def test_cache_is_freed_on_exit():
    lin = torch.nn.Linear(8, 8)
    with mixprec.autocast("cpu"):
        lin(torch.randn(2, 8))
        mode = find_mode()
        cast_w = weakref.ref(next(v[3] for v in mode.cache.values() if v[0] is lin.weight))
    assert not mode.cache
    gc.collect()
    assert cast_w() is None


# ------------------------------------------------------------------------------------ backward


def test_backward_matches_torch_autocast_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4)
    )
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    grads = []
    for ctx in (torch.autocast("cpu"), mixprec.autocast("cpu")):
        model.zero_grad()
        with ctx:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g_torch, g_ours in zip(*grads, strict=True):
        assert g_ours.dtype == FP32
        assert torch.equal(g_torch, g_ours)


# -------------------------------------------------------------------------------------- errors


def test_error_unknown_device_type():
    with pytest.raises(mixprec.PolicyError, match="Valid device types: 'cpu', 'cuda'"):
        mixprec.autocast("tpu")
    # torch raises a RuntimeError: code written for it catches ours too.
    with pytest.raises(RuntimeError):
        torch.autocast("tpu")
    with pytest.raises(RuntimeError, match="unknown device type 'tpu'"):
        mixprec.autocast("tpu")
    with pytest.raises(RuntimeError, match="unknown device type 'gpu'"):
        mixprec.is_autocast_enabled("gpu")


def test_error_dtype_names():
    with pytest.raises(mixprec.PolicyError, match="unknown dtype 'int8'"):
        mixprec.autocast("cpu", dtype="int8")
    with pytest.raises(mixprec.PolicyError, match="unknown dtype 'int8'"):
        mixprec.autocast("cpu", dtype="int8", enabled=False)


def _inside(region) -> tuple:
    with region:
        y = torch.randn(2, 2) @ torch.randn(2, 2)
        return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), y.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_disabled_region_takes_any_dtype_as_torch_does(dtype, recwarn):
    # The `autocast(dtype=..., enabled=use_amp)` pattern with fp32 for the fp32 baseline.
    ref = _inside(torch.autocast("cpu", dtype=dtype, enabled=False))
    region = mixprec.autocast("cpu", dtype=dtype, enabled=False)
    assert _inside(region) == ref == (False, dtype, torch.float32)
    assert not region.enabled and region.dtype == dtype
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # restored
    assert not recwarn.list


def test_enabled_region_with_fp32_warns_and_runs_disabled_as_torch_does():
    with pytest.warns(UserWarning, match="target dtype is not supported. Disabling autocast"):
        ref = _inside(torch.autocast("cpu", dtype=torch.float32))
    with pytest.warns(UserWarning, match=r"region is disabled.*Pass enabled=False"):
        region = mixprec.autocast("cpu", dtype=torch.float32)
    assert _inside(region) == ref == (False, torch.float32, torch.float32)


def test_error_argument_types():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        mixprec.autocast("cpu", enabled="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache_enabled must be a bool or None"):
        mixprec.autocast("cpu", cache_enabled=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy must be a mixprec.Policy"):
        mixprec.autocast("cpu", policy=42)  # type: ignore[arg-type]


def test_cuda_region_without_cuda_warns_and_disables():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        region = mixprec.autocast("cuda")
    assert region.enabled is False
    with region:
        assert not mixprec.is_autocast_enabled("cuda")


def test_error_exit_out_of_order():
    from torch.overrides import TorchFunctionMode

    region = mixprec.autocast("cpu")
    region.__enter__()
    other = TorchFunctionMode()
    other.__enter__()
    with pytest.raises(mixprec.AutocastError, match="reverse order"):
        region.__exit__(None, None, None)
    other.__exit__(None, None, None)
    torch.overrides._pop_mode()  # clean up the region's mode left by the refused exit
    assert _stack_len() == 0


def test_region_dtype_reason_is_printable():
    assert "requested by the dtype argument" in mixprec.autocast("cpu", dtype="bf16").dtype_reason
    assert "CPU default" in mixprec.autocast("cpu").dtype_reason
    assert "mixprec.autocast('cpu'" in repr(mixprec.autocast("cpu"))


def test_mode_pushes_and_pops_exactly_once():
    # The module object itself: Python 3.10's mock resolves "mixprec.eager.autocast" to the
    # class of that name, which the package re-exports.
    module = sys.modules["mixprec.eager.autocast"]
    with (
        mock.patch.object(module, "_push_mode", wraps=torch.overrides._push_mode) as push,
        mixprec.autocast("cpu"),
        mixprec.autocast("cpu", dtype=FP16),
    ):
        pass
    assert push.call_count == 1


def test_decorating_a_non_callable_names_the_context_manager_form():
    # torch's message, which torch's own test matches, with mixprec's region in the example.
    # torch 2.11 did not check yet (it returned a wrapper that fails when called): there the
    # message is checked against what later releases say.
    torch_message = (
        "autocast()(func) requires a callable, but got int. Did you mean to use autocast as a "
        "context manager? For example:\n    with torch.autocast(device_type=...):\n"
        "        output = model(input)"
    )
    try:
        torch.autocast("cpu")(42)  # type: ignore[arg-type]
    except TypeError as ref:
        torch_message = str(ref)
    with pytest.raises(TypeError) as err:
        mixprec.autocast("cpu")(42)  # type: ignore[arg-type]
    assert str(err.value) == "mixprec." + torch_message.replace(
        "with torch.autocast(device_type=...)", "with mixprec.autocast('cpu')"
    )
