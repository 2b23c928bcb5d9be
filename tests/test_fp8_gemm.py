"""The FP8 GEMM path chosen per machine (mixprec.fp8.gemm), and the CPU kernels under it.

- The table decode of FP8 to fp32 equals torch's own conversion, bit for bit, for every one of
  the 256 codes of both formats (NaNs included), and for transposed operands.
- The CPU amax (``aminmax``) equals ``vector_norm(t, inf)``, NaN and inf included; the amax read
  from FP8 bytes equals the amax of the FP8 values.
- The choice: measured once per shape class and then looked up (no timing on the hot path); a
  ``_scaled_mm`` slower than emulation is never chosen, and a clearly slower one is dropped
  after one probe pair; one faster in every pair is chosen; ties go to emulation. The speeds
  are stand-ins here (our own functions slowed down); the real ones are in docs/fp8.md.
- Overrides: ``set_gemm_path`` and ``MIXPREC_FP8_GEMM``, checked, listing the valid paths.
- The report says which path each layer's products took.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

import mixprec
from mixprec.fp8 import gemm
from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.numerics import amax, fp8_amax
from mixprec.fp8.recipe import E4M3, E5M2


@pytest.fixture(autouse=True)
def _fresh_choices():
    gemm.set_gemm_path(None)
    yield
    gemm.set_gemm_path(None)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_decode_equals_torchs_conversion_for_every_code(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)
    q = codes.repeat(gemm._LUT_MIN // 256).reshape(-1, 64)  # large enough for the table
    for t in (q, q.t()):  # row-major and a transposed view
        got, ref = gemm.decode(t), t.float()
        assert got.shape == ref.shape
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
        assert torch.equal(got.nan_to_num(0.0), ref.nan_to_num(0.0))
        assert torch.equal(torch.signbit(got), torch.signbit(ref))  # -0.0 stays -0.0


def test_cpu_amax_equals_vector_norm_inf():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(33, 17, dtype=dtype) * 5
        ref = torch.linalg.vector_norm(t, math.inf)
        assert torch.equal(amax(t), ref.float())
        rows = torch.linalg.vector_norm(t, math.inf, dim=1, keepdim=True)
        assert torch.equal(amax(t, dim=1), rows.float())
        t[3, 4] = -math.inf
        assert amax(t).item() == math.inf
        t[5, 6] = math.nan
        assert math.isnan(amax(t).item()) and math.isnan(amax(t, dim=1)[5, 0].item())


def test_amax_read_from_fp8_bytes():
    torch.manual_seed(1)
    for fmt in (E4M3, E5M2):
        q = (torch.randn(64, 32) * 40).to(fmt)
        assert fp8_amax(q).item() == q.float().abs().max().item()
        q.view(torch.uint8)[7, 3] = 0xFF  # a NaN code (negative NaN in both formats)
        assert math.isnan(fp8_amax(q).item())


def _product(m=64, k=64, n=64):
    a = torch.randn(m, k).to(E4M3)
    b = torch.randn(n, k).to(E4M3).t()
    return a, b


def _slowed(fn, seconds):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="this torch has no _scaled_mm")
def test_a_slower_scaled_mm_is_never_chosen_and_the_choice_is_cached(monkeypatch):
    if not gemm.scaled_mm_available(torch.device("cpu")):
        pytest.skip("this torch build cannot run _scaled_mm on the CPU")
    calls = []
    real_scaled = gemm.scaled
    monkeypatch.setattr(gemm, "scaled", _slowed(real_scaled, 0.1))
    real_measure = gemm._measure
    monkeypatch.setattr(gemm, "_measure", lambda *a: calls.append(a) or real_measure(*a))
    a, b = _product()
    assert gemm.gemm_path(a, b, False, torch.float32) == "emulate"
    (choice,) = gemm.gemm_choices().values()
    assert choice.how == "measured" and choice.scaled_mm_ms > choice.emulate_ms
    assert choice.probe == (32, 32, 32)  # clearly slower at the first probe: decided there
    # The same class (sizes round up to the same powers of two) is looked up, not measured.
    a2, b2 = _product(50, 60, 40)
    assert gemm.gemm_path(a2, b2, False, torch.float32) == "emulate" and len(calls) == 1
    assert gemm.gemm_path(a, b, True, torch.float32) == "emulate" and len(calls) == 2  # rowwise
    assert "emulate (measured at 32x32x32: scaled_mm" in str(choice)


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="this torch has no _scaled_mm")
def test_a_faster_scaled_mm_is_chosen_and_a_tie_goes_to_emulation(monkeypatch):
    if not gemm.scaled_mm_available(torch.device("cpu")):
        pytest.skip("this torch build cannot run _scaled_mm on the CPU")
    real_emulated = gemm.emulated
    monkeypatch.setattr(gemm, "emulated", _slowed(real_emulated, 0.1))
    a, b = _product()
    assert gemm.gemm_path(a, b, False, torch.float32) == "scaled_mm"
    (choice,) = gemm.gemm_choices().values()
    # Emulation took over PROBE_MS at the first probe: that probe stands for the class.
    assert choice.probe == (32, 32, 32) and choice.scaled_mm_ms < choice.emulate_ms
    gemm.set_gemm_path(None)
    monkeypatch.setattr(gemm, "scaled", _slowed(gemm.scaled, 0.1))  # both equally slow
    assert gemm.gemm_path(a, b, False, torch.float32) == "emulate"


def test_overrides_are_checked_and_forced(monkeypatch):
    a, b = _product()
    gemm.set_gemm_path("emulate")
    assert gemm.gemm_path(a, b, False, torch.float32) == "emulate"
    assert next(iter(gemm.gemm_choices().values())).how == "override"
    with pytest.raises(mixprec.PolicyError, match="Valid: 'auto', 'emulate' or 'scaled_mm'"):
        gemm.set_gemm_path("cublas")
    monkeypatch.setenv(gemm.ENV, "EMULATE")
    gemm._FORCED.clear()  # the environment is read at the first decision after this
    gemm._CHOICES.clear()
    assert gemm.gemm_path(a, b, False, torch.float32) == "emulate"
    monkeypatch.setenv(gemm.ENV, "fast")
    gemm._FORCED.clear()
    gemm._CHOICES.clear()
    with pytest.raises(mixprec.PolicyError, match="MIXPREC_FP8_GEMM: 'fast' is not"):
        gemm.gemm_path(a, b, False, torch.float32)


def test_the_report_says_which_path_each_layer_took():
    torch.manual_seed(0)
    gemm.set_gemm_path("emulate")
    layer = Fp8Linear(32, 48, recipe="tensorwise")
    assert mixprec.fp8_report(layer).layers[0].gemm == "not run"
    layer(torch.randn(20, 32))
    assert mixprec.fp8_report(layer).layers[0].gemm == "emulate (backward not run yet)"
    layer(torch.randn(20, 32, requires_grad=True)).sum().backward()
    (row,) = mixprec.fp8_report(layer).layers
    assert row.gemm == "emulate" and row.formats == "e4m3 x e4m3, grad e5m2"
    assert "e4m3/e4m3/e5m2" in str(mixprec.fp8_report(layer))
    emulated = Fp8Linear(32, 48, recipe=mixprec.Fp8Recipe.named("rowwise").replace(emulate=True))
    emulated(torch.randn(4, 32))
    (row,) = mixprec.fp8_report(emulated).layers
    assert row.gemm == "emulate (recipe)" and row.formats == "e4m3 x e4m3, grad e4m3"


def test_the_report_says_how_the_quantisation_runs():
    from mixprec.fp8 import fused

    layer = Fp8Linear(32, 48, recipe="tensorwise")
    assert mixprec.fp8_report(layer).layers[0].quantize == "eager"  # CPU: auto keeps eager
    assert "(quantisation: eager)" in str(mixprec.fp8_report(layer))
    fused.set_quantize_mode("compiled")
    try:
        assert mixprec.fp8_report(layer).layers[0].quantize == "compiled"
    finally:
        fused.set_quantize_mode(None)
