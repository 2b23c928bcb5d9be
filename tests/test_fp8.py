"""FP8 numerics on the CPU: each FP8 matmul, the saturating cast, and the delayed-scale update.

Every product of an FP8 linear layer (forward ``x @ w.T``, backward ``g @ w`` and ``g.T @ x``)
is checked two ways, through the layer's own forward and autograd backward:

- *exactly*: on operands that FP8 represents without loss (FP8 values times a power of two,
  with one entry at the format's max so the dynamic scale is that power of two), the result
  must equal the fp64 product up to fp32 accumulation order;
- *against the unquantised product*: on normal random data, the error must stay within the
  bound e4m3/e5m2 rounding allows (relative 2**-4 / 2**-3 per operand, plus subnormal spacing),
  computed element by element.

Both run on ``torch._scaled_mm`` (torch 2.13 runs it on the CPU) and on the emulated path.
Runs on CPU in a few seconds.
"""

from __future__ import annotations

import math

import pytest
import torch

import mixprec
from mixprec.fp8 import gemm
from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.numerics import quantize, scale_from_amax
from mixprec.fp8.recipe import E4M3, E5M2, RECIPES, Fp8Recipe
from mixprec.fp8.state import Fp8State, init_state, update_history

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
# Unit roundoff (half an ulp, relative) and half the smallest subnormal, per format.
UNIT = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HALF_SUB = {E4M3: 2.0**-10, E5M2: 2.0**-17}

RECIPE_CASES = [
    RECIPES["tensorwise"],
    RECIPES["tensorwise"].replace(grad_dtype="e4m3"),
    RECIPES["delayed"],
    RECIPES["rowwise"],
]


def _ids(r: Fp8Recipe) -> str:
    return r.summary().replace(" ", "")


@pytest.fixture(autouse=True)
def _scaled_mm_when_asked(request):
    """Tests parametrised "scaled_mm" run torch._scaled_mm itself, whatever this machine's
    measured choice (mixprec.fp8.gemm) would be."""
    callspec = getattr(request.node, "callspec", None)
    forced = callspec is not None and callspec.params.get("emulate") in (False, "per-tensor")
    if forced:
        gemm.set_gemm_path("scaled_mm")
    yield
    if forced:
        gemm.set_gemm_path(None)


def _layer(recipe: Fp8Recipe, k: int, n: int, emulate: bool, seed: int = 0) -> Fp8Linear:
    torch.manual_seed(seed)
    layer = Fp8Linear(k, n, bias=False, recipe=recipe.replace(emulate=emulate, name=recipe.name))
    return layer


def _representable(shape, dtype: torch.dtype, fmax: float, exp: int, axes=()) -> torch.Tensor:
    """Random values FP8 holds exactly, times 2**exp; the amax (overall and along each axis in
    `axes`) is exactly fmax * 2**exp, so every dynamic scale is the power of two 2**-exp."""
    t = (torch.randn(shape) * fmax / 8).clamp(-fmax, fmax).to(dtype).float()
    t[0, 0] = fmax
    for axis in axes:  # rowwise scales: one max entry per row (axis 1) / per column (axis 0)
        idx = torch.arange(t.shape[1 - axis])
        pos = torch.randint(0, t.shape[axis], (len(idx),))
        if axis == 1:
            t[idx, pos] = -fmax
        else:
            t[pos, idx] = fmax
    return t * 2.0**exp


def _accumulation_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How far an fp32 sum of the K products may be from the fp64 one (any order)."""
    k = a.shape[1]
    return 2 * k * 2.0**-24 * (a.abs().double() @ b.abs().double()) + 1e-30


def _run(layer: Fp8Linear, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(g)
    return out.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize(
    "emulate", [False, True, "per-tensor"], ids=["scaled_mm", "emulated", "per_tensor_kernel"]
)
@pytest.mark.parametrize("recipe", RECIPE_CASES, ids=_ids)
@pytest.mark.parametrize("m", [32, 19])  # 19 tokens: the weight-gradient GEMM pads K to 32
def test_each_fp8_product_is_exact_on_representable_operands(recipe, emulate, m, monkeypatch):
    if emulate == "per-tensor":  # a _scaled_mm without rowwise scales (torch 2.11's CPU kernel)
        if not recipe.rowwise:
            pytest.skip("only rowwise scales need the per-tensor fallback")
        from mixprec import _compat

        monkeypatch.setitem(_compat._SCALED_MM, ("cpu", None, True), False)
        emulate = False
    k, n = 48, 32
    layer = _layer(recipe, k, n, emulate)
    gdt, gmax = recipe.grad_dtype, (E5M2_MAX if recipe.grad_dtype is E5M2 else E4M3_MAX)
    axes = (0, 1) if recipe.rowwise else ()
    x = _representable((m, k), E4M3, E4M3_MAX, -9, axes)
    w = _representable((n, k), E4M3, E4M3_MAX, -6, axes)
    g = _representable((m, n), gdt, gmax, -20, axes)
    with torch.no_grad():
        layer.weight.copy_(w)
    out, gx, gw = _run(layer, x, g)
    xd, wd, gd = x.double(), w.double(), g.double()
    for got, ref, bound in (
        (out, xd @ wd.t(), _accumulation_bound(x, w.t())),
        (gx, gd @ wd, _accumulation_bound(g, w)),
        (gw, gd.t() @ xd, _accumulation_bound(g.t(), x)),
    ):
        # rowwise GEMMs write bf16 (as the GPU kernels must): one more rounding, 2**-9 relative
        slack = 2.0**-8 * ref.abs() if recipe.rowwise else 0.0
        assert got.dtype == torch.float32
        assert ((got.double() - ref).abs() <= bound + slack).all()


def _quantisation_bound(a, b, fmt_a, fmt_b, scale_a, scale_b) -> torch.Tensor:
    """Elementwise bound on |a @ b - qa @ qb| for operands rounded to nearest in their formats
    (relative error UNIT, absolute error HALF_SUB / scale in the subnormal range)."""
    ea = UNIT[fmt_a] * a.abs().double() + HALF_SUB[fmt_a] / scale_a
    eb = UNIT[fmt_b] * b.abs().double() + HALF_SUB[fmt_b] / scale_b
    ad, bd = a.abs().double(), b.abs().double()
    return ea @ bd + ad @ eb + ea @ eb + _accumulation_bound(a, b)


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
@pytest.mark.parametrize("recipe", RECIPE_CASES, ids=_ids)
def test_each_fp8_product_is_within_the_format_bound_of_the_unquantised_product(recipe, emulate):
    m, k, n = 64, 96, 48
    layer = _layer(recipe, k, n, emulate, seed=3)
    torch.manual_seed(4)
    x, g = torch.randn(m, k) * 3.0, torch.randn(m, n) * 1e-4
    w = layer.weight.detach().clone()
    out, gx, gw = _run(layer, x, g)
    gdt = recipe.grad_dtype
    xd, wd, gd = x.double(), w.double(), g.double()

    def scale(t, fmax=E4M3_MAX):  # the smallest scale any row gets: the largest subnormal step
        return fmax / t.abs().max().item() / (2 if recipe.power_of_two else 1)

    sg = scale(g, E5M2_MAX if gdt is E5M2 else E4M3_MAX)
    cases = (
        (out, xd @ wd.t(), (x, w.t(), E4M3, E4M3, scale(x), scale(w))),
        (gx, gd @ wd, (g, w, gdt, E4M3, sg, scale(w))),
        (gw, gd.t() @ xd, (g.t(), x, gdt, E4M3, sg, scale(x))),
    )
    for got, ref, args in cases:
        bound = _quantisation_bound(*args)
        if recipe.rowwise:
            bound = bound + 2.0**-8 * ref.abs()
        assert ((got.double() - ref).abs() <= bound).all()
        # ... and the bound is not vacuous: the typical error is a few percent at most.
        rel = (got.double() - ref).norm() / ref.norm()
        assert rel < (0.1 if args[2] is E5M2 else 0.06), rel


def test_quantize_rounds_to_nearest_and_saturates():
    values = torch.tensor([0.0, 1.0, 1.0625, 1.07, 447.0, 448.0, 470.0, 1e9, -1e9])
    q = quantize(values, torch.tensor(1.0), E4M3, E4M3_MAX).float()
    # 1.0625 is the midpoint of 1.0 and 1.125: ties go to even (1.0); 1.07 rounds up.
    assert q.tolist() == [0.0, 1.0, 1.0, 1.125, 448.0, 448.0, 448.0, 448.0, -448.0]
    inf = quantize(torch.tensor([math.inf, math.nan]), torch.tensor(1.0), E4M3, E4M3_MAX).float()
    assert inf[0].item() == 448.0 and math.isnan(inf[1].item())  # saturated, never inf


def test_scales_are_fmax_over_amax_and_powers_of_two_round_down():
    amax = torch.tensor([2.0, 3.0, 0.0, math.inf])
    assert scale_from_amax(amax, 448.0).tolist() == pytest.approx([224.0, 448 / 3, 448e12, 0.0])
    pow2 = scale_from_amax(torch.tensor([2.0, 3.0]), 448.0, power_of_two=True)
    assert pow2.tolist() == [128.0, 128.0]  # 224 -> 128, 149.3 -> 128


# ------------------------------------------------------------------ the delayed-scale update


def test_history_and_scales_follow_a_hand_computation():
    recipe = Fp8Recipe(scaling="delayed", history_len=3, margin=1)
    state = init_state(recipe)
    assert state.scale.tolist() == [math.inf] * 3  # no history: the first step scales dynamically
    steps = [(2.0, 0.5, 100.0), (4.0, 0.25, 50.0), (1.0, 0.5, 400.0), (1.0, 0.125, 10.0)]
    hist = [[], [], []]
    for pending in steps:
        state = update_history(state, torch.tensor(pending), recipe)
        for i, a in enumerate(pending):
            hist[i] = [a, *hist[i]][:3]
        fmax = (448.0, 448.0, 57344.0)
        expected = [fmax[i] / max(hist[i]) / 2 for i in range(3)]  # margin 1: one more halving
        assert state.scale.tolist() == pytest.approx(expected, rel=1e-6)
        assert state.history[:, : len(hist[0])].tolist() == hist
    # The window drops the oldest: after step 4 the input history is [1, 1, 4].
    assert state.scale[0].item() == pytest.approx(448 / 4 / 2)


def test_most_recent_uses_the_newest_amax_and_power_of_two_rounds():
    recipe = Fp8Recipe(scaling="delayed", history_len=4, amax_compute="most_recent",
                       power_of_two=True)  # fmt: skip
    state = init_state(recipe)
    for pending in [(8.0, 1.0, 1.0), (3.0, 1.0, 1.0)]:
        state = update_history(state, torch.tensor(pending), recipe)
    assert state.scale[0].item() == 128.0  # 448 / 3 = 149.3, rounded down to 2**7


def test_skipped_unseen_and_nonfinite_amaxes_leave_the_state_exactly():
    recipe = RECIPES["delayed"]
    state = update_history(init_state(recipe), torch.tensor([2.0, 1.0, 3.0]), recipe)
    before = Fp8State(state.history.clone(), state.scale.clone())
    skipped = update_history(state, torch.tensor([9.0, 9.0, 9.0]), recipe, torch.tensor(1.0))
    assert torch.equal(skipped.history, before.history)
    assert torch.equal(skipped.scale, before.scale)
    odd = update_history(state, torch.tensor([0.0, math.inf, math.nan]), recipe, torch.tensor(0))
    assert torch.equal(odd.history, before.history) and torch.equal(odd.scale, before.scale)
    ran = update_history(state, torch.tensor([5.0, 0.0, 1.0]), recipe, torch.tensor(0.0))
    assert ran.history[0, :2].tolist() == [5.0, 2.0]
    assert torch.equal(ran.history[1], before.history[1])  # weight amax 0: not seen


def test_layer_uses_the_delayed_scale_capped_by_the_current_amax():
    recipe = RECIPES["delayed"]
    layer = Fp8Linear(32, 16, bias=False, recipe=recipe)
    x = torch.randn(8, 32)
    x[0, 0] = 2.0 if x.abs().max() < 2 else x[0, 0]
    layer(x)
    assert layer.fp8_fwd[2].item() == pytest.approx(448 / x.abs().max().item())  # no history
    layer.fp8_scale.fill_(10.0)  # a delayed scale below the current one: it is used
    layer(x)
    assert layer.fp8_fwd[2].item() == 10.0
    layer.fp8_scale.fill_(1e6)  # above: the current amax caps it (nothing saturates)
    layer(x * 100)
    assert layer.fp8_fwd[2].item() == pytest.approx(448 / (100 * x.abs().max().item()))
    # True delayed scaling: dynamic until the first update, then the prepared scale as it is.
    saturating = Fp8Linear(32, 16, bias=False, recipe=recipe.replace(overflow="saturate"))
    saturating(x)
    assert saturating.fp8_fwd[2].item() == pytest.approx(448 / x.abs().max().item())
    mixprec.fp8_update([saturating])
    saturating.fp8_next.fill_(1e6)
    out = saturating(x * 100)  # clipped at +-448/1e6, but finite
    assert saturating.fp8_fwd[2].item() == 1e6 and torch.isfinite(out).all()
    # The amax was read from the FP8 bytes: saturated, so twice the clipping threshold.
    assert saturating.fp8_fwd[0].item() == pytest.approx(2 * 448 / 1e6)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_an_outlier_batch_after_calm_steps_gives_no_inf_or_nan(recipe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = mixprec.initialize(model, opt, "O1", dtype="bf16", fp8=recipe)
    for i in range(6):
        x = torch.randn(16, 32) * (1e5 if i == 5 else 1.0)  # bf16 carries 1e5; e4m3 only 448
        opt.zero_grad()
        out = model(x)
        loss = out.float().pow(2).mean() * (1e-10 if i == 5 else 1.0)
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        assert torch.isfinite(out).all(), i
        assert all(torch.isfinite(p.grad).all() for p in model.parameters()), i
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_recipes_are_named_frozen_and_printable():
    assert Fp8Recipe.named("delayed") is RECIPES["delayed"]
    text = str(RECIPES["delayed"])
    assert "Transformer Engine" in text and "history_len   = 16" in text
    with pytest.raises(AttributeError):  # frozen
        RECIPES["delayed"].margin = 2  # type: ignore[misc]
    assert RECIPES["delayed"].replace(margin=2).name == "delayed+"
    with pytest.raises(mixprec.PolicyError, match="Did you mean 'rowwise'"):
        Fp8Recipe.named("rowwis")
    with pytest.raises(mixprec.PolicyError, match="dynamic only"):
        Fp8Recipe(scaling="delayed", granularity="rowwise", grad_dtype="e4m3")
    with pytest.raises(mixprec.PolicyError, match="e4m3 gradients"):
        Fp8Recipe(granularity="rowwise")
    with pytest.raises(mixprec.PolicyError, match="Valid: 'e4m3' or 'e5m2'"):
        Fp8Recipe(grad_dtype="fp16")
    with pytest.raises(mixprec.PolicyError, match="no field 'window'"):
        RECIPES["delayed"].replace(window=4)


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_without_clamp_is_bitwise_the_saturating_cast_for_fitting_scales(src, fmt):
    """The eager quantisation skips the clamp where the scale comes from the tensor's own amax
    (a pass less); the bits must equal the clamped fp32 formula, also where the rounded
    product lands just above fmax, for tensorwise and rowwise scales and non-finite inputs."""
    from mixprec.fp8.numerics import _fp32_product, amax, quantize, scale_from_amax
    from mixprec.fp8.recipe import fp8_max

    fmax = fp8_max(fmt)
    g = torch.Generator().manual_seed(0)

    def reference(t, scale):  # the formula as written: fp32 copy, scale, clamp, cast
        return t.to(torch.float32, copy=True).mul_(scale).clamp_(-fmax, fmax).to(fmt)

    cases = [torch.randn(64, 96, generator=g) * 10 ** torch.randint(-6, 6, (64, 1), generator=g)]
    odd = torch.rand(64, 96, generator=g) * 3 + 1  # amaxes whose scale rounds up
    odd[:, 0] = torch.linspace(1, 3, 64)
    cases += [odd, torch.zeros(8, 8), torch.full((4, 4), 1e-20)]
    bad = torch.randn(16, 16, generator=g)
    bad[3, 4], bad[7, 1] = float("inf"), float("nan")
    cases.append(bad)
    for t in (c.to(src) for c in cases):
        for p2 in (False, True):
            scale = scale_from_amax(amax(t), fmax, p2)
            ref = reference(t, scale).view(torch.uint8)
            assert torch.equal(quantize(t, scale, fmt, fmax, False).view(torch.uint8), ref)
            assert torch.equal(quantize(t, scale, fmt, fmax).view(torch.uint8), ref)
            rows = scale_from_amax(amax(t, dim=1), fmax, p2)
            ref_rows = reference(t, rows).view(torch.uint8)
            assert torch.equal(quantize(t, rows, fmt, fmax, False).view(torch.uint8), ref_rows)
            # the GPU's one-pass product (type promotion) gives the CPU's two-pass bits
            for s in (scale, rows):
                one = _fp32_product(t, s, one_pass=True)
                assert one.dtype == torch.float32
                assert torch.equal(one.nan_to_num(7.0), _fp32_product(t, s, False).nan_to_num(7.0))


@pytest.mark.compile
def test_compiled_quantisation_has_the_eager_bits_and_does_not_recompile_per_shape():
    """`mixprec.fp8.fused` compiles the quantisation (amax, scale, cast) into two kernels on
    CUDA; the values must be the eager formula's, non-finite inputs included. Inductor's CPU
    backend checks the traced formula here (the GPU's code generator in test_fp8_cuda.py)."""
    from mixprec.fp8 import fused, ops
    from mixprec.fp8.recipe import fp8_max

    g = torch.Generator().manual_seed(0)
    delayed = torch.tensor(30.0)
    cases = [(None, (True, False, False), E4M3), (1, (False, False, True), E5M2)]
    try:
        for dim, flags, fmt in cases:
            fmax = fp8_max(fmt)
            for rows in (64, 37):  # a second token count: dynamic shapes, no recompile
                t = (torch.randn(rows, 96, generator=g) * 5).to(torch.bfloat16)
                t[3, 5], t[7, 1] = float("inf"), float("nan")
                fused.set_quantize_mode("eager")
                want = ops._q(t, dim, delayed, fmax, fmt, flags)
                fused.set_quantize_mode("compiled")
                # an activation that requires grad, then a weight: one variant, compiled once
                arg = t.requires_grad_() if rows == 64 else torch.nn.Parameter(t)
                with torch._dynamo.config.patch(error_on_recompile=rows == 37):
                    got = ops._q(arg, dim, delayed, fmax, fmt, flags)
                t = t.detach()
                for a, b in zip(want, got, strict=True):
                    # NaN where the eager result is NaN (its sign bit may differ: x86's
                    # default NaN is negative), the same bits everywhere else.
                    nan = a.float().isnan()
                    assert torch.equal(nan, b.float().isnan())
                    if a.dtype == fmt:
                        a, b = a.view(torch.uint8), b.view(torch.uint8)
                    assert torch.equal(a[~nan], b[~nan])
        assert fused.failures() == {}
    finally:
        fused.set_quantize_mode(None)


def test_quantisation_mode_is_checked_and_auto_keeps_the_cpu_eager(monkeypatch):
    from mixprec.fp8 import fused

    with pytest.raises(mixprec.PolicyError, match="'auto', 'compiled' or 'eager'"):
        fused.set_quantize_mode("fast")
    fused.set_quantize_mode(None)
    assert fused.quantize_mode() == "auto" and not fused.use_compiled(torch.ones(2))
    monkeypatch.setattr(fused, "_MODE", [])
    monkeypatch.setenv(fused.ENV, "Eager")
    assert fused.quantize_mode() == "eager"
    monkeypatch.setattr(fused, "_MODE", [])
    monkeypatch.setenv(fused.ENV, "jit")
    with pytest.raises(mixprec.PolicyError, match=fused.ENV):
        fused.quantize_mode()
