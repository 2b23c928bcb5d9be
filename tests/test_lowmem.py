"""Low-memory training state (`mixprec.optim`, opt level O4, issue 25).

References: torch's own AdamW/Adam/SGD (our optimizers with fp32 states on fp32 weights must
follow them to fp32 rounding), fp64 arithmetic (what stochastic rounding must equal on
average, what Kahan must track), brute-force nearest-code search (the quantizer), and the
uncompiled TrainStep (the compiled one must round identically: same counter-hash bits).
"""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.optim import LowMemAdam, LowMemAdamW, LowMemSGD, codes, converted, memory_report
from mixprec.optim.rounding import (
    counter_stream,
    hash_bits,
    join_master,
    kahan_add,
    split_master,
    stochastic_round,
    uniform,
    unpack_halves,
)

FAST = {"backend": "aot_eager", "kernels": "native"}


def _mlp(seed: int = 0, width: int = 96) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.LayerNorm(width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4),
    )  # fmt: skip


def _batches(n: int, overflows=(), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(16, 16, generator=g)
        if i in overflows:
            x[0, 0] = float("inf")
        out.append((x, torch.randint(0, 4, (16,), generator=g)))
    return out


def _state_bits(opt) -> list[torch.Tensor]:
    inner = getattr(opt, "optimizer", opt)
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            out.append(p.detach().clone())
            out += [v.clone() for v in inner.state.get(p, {}).values() if torch.is_tensor(v)]
    return out


def _bitwise(a, b) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


# ---------------------------------------------------------------------- the 8-bit code


@pytest.mark.parametrize("signed", [True, False])
def test_the_quartic_code_spans_eight_decades_with_bounded_relative_steps(signed):
    code = codes.code_values(signed)
    assert code.shape == ((255,) if signed else (256,)) and torch.all(code[1:] > code[:-1])
    assert 0.0 in code.tolist() and code[-1] == 1.0
    assert (code[0] == -1.0) if signed else (code[0] == 0.0)
    if signed:  # symmetric: -q holds minus q's value
        assert torch.equal(code, -code.flip(0))
    # A linear 8-bit code would stop at 1/128 of the block maximum; this one keeps values down
    # to ~4e-9 (signed) or ~2e-10 (unsigned), and its relative step shrinks as 4/q toward 1.
    positive = code[code > 0]
    assert positive[0] < (4e-9 if signed else 3e-10)
    rel = (positive[1:] - positive[:-1]) / positive[1:]
    above = positive[1:]
    assert rel[above > 0.9].max() < (0.035 if signed else 0.017)
    assert rel[above > 1e-3].max() < (0.19 if signed else 0.1)


def _nearest_in_root(x: torch.Tensor, signed: bool, block: int = 256) -> torch.Tensor:
    """Reference: per element, the code value whose fourth root is nearest x's (brute force)."""
    n = x.numel()
    padded = F.pad(x.double(), (0, codes.padded_size(n, block) - n)).view(-1, block)
    scale = padded.abs().amax(1, keepdim=True)
    r = padded / torch.where(scale > 0, scale, torch.ones_like(scale))
    code = codes.code_values(signed).double()
    root = code.sign() * code.abs().pow(0.25)
    best = (r.sign() * r.abs().pow(0.25)).unsqueeze(-1).sub(root).abs().argmin(-1)
    if not signed:  # a positive second moment is never stored as 0
        best = torch.where((best == 0) & (r > 0), torch.ones_like(best), best)
    return (code[best] * scale).view(-1)[:n].float()


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_picks_the_nearest_code_value_in_the_fourth_root_per_block(signed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, generator=g) * torch.logspace(-4, 1, 3000)
    x = x if signed else x.abs()
    x[512:768] = 0  # a block of zeros
    words, absmax = codes.quantize(x, 256, signed)
    assert codes.padded_size(3000, 256) == 3072 and codes.padded_size(3073, 256) == 4096
    assert words.dtype == torch.int32 and words.shape == (768,)
    assert absmax.shape == (12,) and absmax.dtype == torch.float32
    got = codes.dequantize(words, absmax, signed, x.shape)
    want = _nearest_in_root(x, signed)
    # fp32 against fp64 roots: an element at a tie may land on the other neighbour.
    close = torch.isclose(got, want, rtol=1e-6, atol=0)
    assert close.float().mean() > 0.999, x[~close]
    torch.testing.assert_close(got, want, rtol=0.2, atol=0)
    assert torch.all(got[512:768] == 0)
    # Each block's largest magnitude comes back exactly (the code holds 1.0).
    blocks = F.pad(x, (0, 72)).view(-1, 256)
    big = blocks.abs().argmax(1) + 256 * torch.arange(12)
    keep = big < 3000
    torch.testing.assert_close(got[big[keep]], x[big[keep]], rtol=1e-6, atol=0)


def test_the_four_planes_are_the_tensors_quarters_in_the_words_bytes():
    # Element k * L/4 + j is byte k of word j: a plane decodes from whole words.
    x = torch.zeros(4096)
    for k in range(4):
        x[k * 1024] = k + 1.0  # the maximum of block 4k: code 127
        x[k * 1024 + 1] = -(k + 1.0) * 0.5**4  # fourth root 63.5/127: code -64 (half to even)
    words, absmax = codes.quantize(x, 256, signed=True)
    assert torch.equal(absmax[::4], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert words[0].item() & 0xFFFFFFFF == 0x7F7F7F7F
    assert words[1].item() & 0xFFFFFFFF == 0xC0C0C0C0  # -64 in each byte
    want = x.clone()
    want[1::1024] = -torch.arange(1.0, 5.0) * (64 / 127) ** 4
    torch.testing.assert_close(codes.dequantize(words, absmax, True, x.shape), want)


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_round_trips_its_own_values_and_handles_extremes(signed):
    code = codes.code_values(signed)
    x = code.repeat(8)[: 8 * 255 if signed else 8 * 256]  # every value in every block
    x = F.pad(x, (0, 4096 - x.numel()))
    x[-256:] = 1.0  # so each block's maximum is 1.0 ...
    x = x.view(-1, 256)
    x[:, -1] = 1.0
    x = x.view(-1)
    words, absmax = codes.quantize(x, 256, signed)
    assert torch.equal(codes.dequantize(words, absmax, signed, x.shape), x)
    tiny = torch.tensor([1.0, 1e-30, 0.0, 2**-149] + [0.0] * 252)
    got = codes.dequantize(*codes.quantize(tiny, 256, signed), signed, tiny.shape)
    assert got[0] == 1.0 and got[2] == 0.0
    if not signed:  # positive, however small: never 0
        assert got[1] > 0 and got[3] > 0


@pytest.mark.parametrize("signed", [True, False])
def test_a_given_scale_codes_relative_to_it_and_block_max_pads_as_quantize(signed):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1700, generator=g)
    x = x if signed else x.abs()
    blocks = codes.padded_size(x.numel(), 256) // 256
    exact = codes.block_max(x, 256, blocks)
    assert exact.shape == (8,) and torch.equal(exact[-1], torch.tensor(0.0))  # padding only
    want = F.pad(x, (0, 348)).view(8, 256).abs().amax(1)
    assert torch.equal(exact, want)
    scale = exact * 2.0
    scale[0] = exact[0] * 0.5  # a bound below the block's largest value: coded as the bound
    words, absmax = codes.quantize(x, 256, signed, scale)
    assert torch.equal(absmax, scale)
    got = codes.dequantize(words, absmax, signed, x.shape)
    inside = torch.arange(x.numel()) >= 256
    torch.testing.assert_close(got[inside], x[inside], rtol=0.2, atol=1e-6)
    assert (got[:256].abs() <= scale[0]).all() and (got[:256].abs() == scale[0]).any()


# ---------------------------------------------------------------------- rounding


def test_counter_hash_is_deterministic_uniform_and_changes_with_counter_and_key():
    key, step = torch.tensor(12345), torch.tensor(7.0)
    a = hash_bits(key, step, 1 << 16)
    assert torch.equal(a, hash_bits(key, step, 1 << 16))
    assert a.dtype == torch.int32
    a = a.to(torch.int64) & 0xFFFFFFFF  # the 32 bits, unsigned
    b = hash_bits(key, torch.tensor(8.0), 1 << 16).to(torch.int64) & 0xFFFFFFFF
    c = hash_bits(torch.tensor(54321), step, 1 << 16).to(torch.int64) & 0xFFFFFFFF
    for other in (b, c):
        assert (a == other).float().mean() < 1e-3
        # top 16 bits uncorrelated across counters/keys
        corr = torch.corrcoef(torch.stack([(a >> 16).double(), (other >> 16).double()]))[0, 1]
        assert abs(corr) < 0.02
    top = (a >> 16).double() / 65536
    assert abs(top.mean() - 0.5) < 0.01 and abs(top.var() - 1 / 12) < 0.005


def _murmur_fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


@pytest.mark.parametrize("key", [0, 12345, 0xFFFFFFFF, 0x9E3779B9])
def test_counter_hash_is_murmur3s_finalizer_over_a_weyl_sequence_bit_for_bit(key):
    # The int32 lanes wrap modulo 2^32: the same bits as the hash on unsigned 32-bit ints.
    golden = 0x9E3779B9
    for counter in (0, 1, 7, 2**24):
        step = _murmur_fmix32(key ^ ((counter * golden) & 0xFFFFFFFF))
        got = hash_bits(torch.tensor(key), torch.tensor(float(counter)), 70_000)
        for i in (0, 1, 2, 13, 65_535, 65_536, 69_999):
            want = _murmur_fmix32((i * golden + step) & 0xFFFFFFFF)
            assert got[i].item() & 0xFFFFFFFF == want, (key, counter, i)
        # An offset (a plane of a tensor), across 2^31 (the int64 index path) and 2^32.
        for offset in (2**31 - 5, 2**32 - 5):
            got = hash_bits(torch.tensor(key), torch.tensor(float(counter)), 10, offset)
            for i in range(10):
                want = _murmur_fmix32(((offset + i) * golden + step) & 0xFFFFFFFF)
                assert got[i].item() & 0xFFFFFFFF == want, (key, counter, offset, i)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kahans_rounding_from_bits_is_torchs_conversion(dtype):
    # `_rounded` (what Kahan's compensation reads, computed from bits so compiled code cannot
    # skip the rounding) against torch's own conversion, over random fp32 bit patterns.
    from mixprec.optim.rounding import _rounded

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (1 << 18,), dtype=torch.int64, generator=g)
    x = bits.to(torch.int32).view(torch.float32)
    new, value = _rounded(x, dtype)
    want = x.to(dtype)
    nan = want.isnan()
    assert torch.equal(new.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert torch.equal(value[~nan], want.float()[~nan]) and value[nan].isnan().all()


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    x = torch.full((20000,), 1.0 + 2**-10, dtype=torch.float32)  # a quarter-ulp above 1.0
    stream = counter_stream(torch.tensor(3), torch.tensor(1.0))
    r = stochastic_round(x, stream).float()
    assert set(r.unique().tolist()) <= {1.0, 1.0 + 2**-7}
    assert abs(r.double().mean().item() - (1.0 + 2**-10)) < 2e-4  # E[r] = x
    # Negative values: symmetric in magnitude.
    rn = stochastic_round(-x, stream).float()
    assert torch.equal(rn, -r)
    # A part of the tensor, from its offset, rounds as it does in the whole (the planes of a
    # compiled update share one stream).
    assert torch.equal(stochastic_round(x[5000:7000], stream, 5000).float(), r[5000:7000])
    # Exactly representable values never move; infinities stay.
    exact = torch.tensor([1.0, -2.5, 0.0, float("inf"), -float("inf")])
    stream = counter_stream(torch.tensor(9), torch.tensor(4.0))
    assert torch.equal(stochastic_round(exact, stream).float(), exact)


def test_small_updates_accumulate_with_stochastic_and_kahan_and_vanish_with_nearest():
    # A bf16 weight of 1.0 receives 2000 updates of 1e-4 (1/80 of its ulp): fp64 says 1.2.
    w_sr = torch.ones(4096, dtype=torch.bfloat16)
    w_k, comp = torch.ones(4096, dtype=torch.bfloat16), torch.zeros(4096, dtype=torch.bfloat16)
    w_n = torch.ones(4096, dtype=torch.bfloat16)
    w_s, rest = split_master(torch.ones(4096))
    key = torch.tensor(1)
    for i in range(2000):
        step = torch.tensor(float(i + 1))
        w_sr = stochastic_round(w_sr.float() + 1e-4, counter_stream(key, step))
        w_k, comp = kahan_add(w_k, torch.full((4096,), 1e-4), comp)
        w_n = (w_n.float() + 1e-4).bfloat16()
        w_s, rest = split_master(join_master(w_s, rest) + 1e-4)
    assert torch.all(w_n == 1.0)  # round to nearest: every update lost (O3)
    assert abs(w_sr.double().mean().item() - 1.2) < 2e-3
    # Kahan's bf16 compensation rounds too (7 bits): the sum drifts by a fraction of a percent.
    assert torch.all((w_k.double() + comp.double() - 1.2).abs() < 1e-2)
    # The split master is fp32 itself: fp32's accumulation error, no more.
    assert torch.all((join_master(w_s, rest).double() - 1.2).abs() < 2e-4)
    assert torch.all(w_s == torch.tensor(1.2).bfloat16())


def test_split_master_is_exact_and_its_weight_is_round_to_nearest():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50000, generator=g) * torch.logspace(-30, 30, 50000)
    w, rest = split_master(x)
    assert w.dtype == torch.bfloat16 and rest.dtype == torch.int32  # int32 lanes (see below)
    assert torch.equal(join_master(w, rest).view(torch.int32), x.view(torch.int32))
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(w[~tie], x.bfloat16()[~tie])  # round to nearest, but for exact ties
    # Bit patterns at the edges (carries into the exponent and the sign, all-ones,
    # infinities), against the rule in Python integers: top half plus the low half's top bit.
    edges = [0, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x10000, 0x3F807FFF, 0x3F808000, 0x7F7FFFFF,
             0x7F7F8000, 0x7F800000, 0x80000000, 0x80008000, 0xFF7F8000]  # fmt: skip
    signed = [u - (1 << 32) if u >= 1 << 31 else u for u in edges]
    x = torch.tensor(signed, dtype=torch.int32).view(torch.float32)
    w, rest = split_master(x)
    assert torch.equal(join_master(w, rest).view(torch.int32), x.view(torch.int32))
    top = [((u >> 16) + (u >> 15 & 1)) & 0xFFFF for u in edges]
    assert [b & 0xFFFF for b in w.view(torch.int16).tolist()] == top
    assert rest.tolist() == [u & 0xFFFF for u in edges]
    # A NaN master stays a NaN (its payload may not: the weight is made by a conversion).
    nans = torch.tensor([0x7FC00000, 0x7FFF8000, -1, -0x8000, -0x7FFFFF],
                        dtype=torch.int32).view(torch.float32)  # fmt: skip
    assert join_master(*split_master(nans)).isnan().all()
    # Held two to an int32 word: each half of the tensor reads whole words.
    from mixprec.optim.rounding import pack_halves

    for n in (1, 6, 7):
        low = torch.arange(n, dtype=torch.int32) * 9000 % 65536
        words = pack_halves(low)
        assert words.shape == ((n + 1) // 2,) and words.dtype == torch.int32
        assert torch.equal(unpack_halves(words, n), low)


# ---------------------------------------------------------------------- the optimizers


TORCH_TWINS = {
    "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
              lambda p, **k: LowMemAdamW(p, lr=1e-2, weight_decay=0.1, **k)),
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01, maximize=True),
             lambda p, **k: LowMemAdam(p, lr=1e-2, weight_decay=0.01, maximize=True, **k)),
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
            lambda p, **k: LowMemSGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True,
                                     **k)),
    "sgd-dampening": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.3),
                      lambda p, **k: LowMemSGD(p, lr=0.05, momentum=0.5, dampening=0.3, **k)),
}  # fmt: skip


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(TORCH_TWINS))
def test_fp32_states_on_fp32_weights_follow_torch(name):
    theirs_fn, ours_fn = TORCH_TWINS[name]
    a, b = _mlp(), _mlp()
    _train(a, theirs_fn(a.parameters()), _batches(8))
    _train(b, ours_fn(b.parameters(), states="fp32"), _batches(8))
    torch.testing.assert_close(list(b.parameters()), list(a.parameters()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(TORCH_TWINS))
def test_8bit_states_track_fp32_states_closely(name):
    theirs_fn, ours_fn = TORCH_TWINS[name]
    a, b = _mlp(width=128), _mlp(width=128)
    _train(a, theirs_fn(a.parameters()), _batches(10))
    opt = ours_fn(b.parameters(), states="8bit")
    _train(b, opt, _batches(10))
    big = b[3].weight  # 128x128 = 16384 elements: quantized
    assert opt.state[big]["exp_avg" if "adam" in name else "momentum_buffer"].dtype == torch.int32
    assert opt.state[b[0].bias][next(iter(opt._moments_of(opt.param_groups[0])))[0]].dtype == (
        torch.float32
    )  # < 4096 elements: full precision
    # Elementwise: the weights move as with fp32 states, to about 1% of how far they moved
    # (a few elements with tiny gradients move less: their second moment is overestimated).
    moved = (a[3].weight - _mlp(width=128)[3].weight).abs().median()
    drift = (b[3].weight - a[3].weight).abs()
    assert drift.median() < 0.05 * moved and drift.quantile(0.99) < 0.5 * moved
    x, y = _batches(1, seed=9)[0]
    torch.testing.assert_close(F.cross_entropy(b(x), y), F.cross_entropy(a(x), y), rtol=5e-3,
                               atol=0)  # fmt: skip


def test_split_weights_follow_fp32_masters_bit_for_bit_in_the_master():
    # O2's arithmetic: an fp32 master stepped by AdamW, the model computing with its bf16
    # rounding. The split master must hold exactly what an fp32 master holds.
    ref, ours = _mlp(), _mlp()
    ours.bfloat16()
    masters = [p.detach().bfloat16().float().requires_grad_() for p in ref.parameters()]
    ref_opt = LowMemAdamW(masters, lr=1e-2, states="fp32")
    opt = LowMemAdamW(ours.parameters(), lr=1e-2, states="fp32", weights="split")
    for x, y in _batches(6):
        opt.zero_grad()
        F.cross_entropy(ours(x.bfloat16()).float(), y).backward()
        for m, p in zip(masters, ours.parameters(), strict=True):
            m.grad = p.grad.float()
        ref_opt.step()
        opt.step()
        for m, p in zip(masters, ours.parameters(), strict=True):
            low = unpack_halves(opt.state[p]["lo"], p.numel()).view(p.shape)
            assert torch.equal(join_master(p.detach(), low), m.detach())
            # The weight is m rounded to nearest, except at exact ties (rounded half up).
            tie = (m.detach().view(torch.int32) & 0xFFFF) == 0x8000
            assert torch.equal(p.detach()[~tie], m.detach().bfloat16()[~tie])


def test_converted_keeps_hyperparameters_groups_and_carries_state_over():
    model = _mlp()
    torch_opt = torch.optim.AdamW([{"params": list(model[0].parameters()), "lr": 0.1},
                                   {"params": list(model[3].parameters())}], lr=1e-3,
                                  betas=(0.8, 0.99), weight_decay=0.05)  # fmt: skip
    _train(model, torch_opt, _batches(2))
    low = converted(torch_opt, weights="nearest", states="fp32")
    assert isinstance(low, LowMemAdamW)
    assert [g["lr"] for g in low.param_groups] == [0.1, 1e-3]
    assert low.param_groups[1]["betas"] == (0.8, 0.99)
    p = model[0].weight
    assert torch.equal(low.state[p]["exp_avg"], torch_opt.state[p]["exp_avg"])
    assert low.state[p]["step"].item() == 2
    with pytest.raises(mixprec.PolicyError, match="AdamW, Adam or SGD|'Adam', 'AdamW' or 'SGD'"):
        converted(torch.optim.RMSprop(model.parameters()))
    with pytest.raises(mixprec.PolicyError, match="amsgrad"):
        converted(torch.optim.Adam(model.parameters(), amsgrad=True))


def test_bad_settings_name_the_valid_ones():
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))]
    with pytest.raises(mixprec.PolicyError, match="kahan"):
        LowMemAdamW(params, weights="stochastic")
    with pytest.raises(mixprec.PolicyError, match="'8bit'"):
        LowMemAdamW(params, states="4bit", weights="kahan")
    with pytest.raises(mixprec.PolicyError, match="block_size"):
        LowMemAdamW(params, block_size=0, weights="kahan")
    # What torch's optimizers refuse, and what failed only at the first step, without a name.
    for kwargs, match in [({"min_quantized": "4096"}, "min_quantized='4096' must be an int"),
                          ({"betas": (0.9, 0.99, 0.5)}, r"betas=.*two numbers"),
                          ({"lr": -1e-3}, "lr=-0.001 is invalid"),
                          ({"eps": -1.0}, "eps=-1.0 is invalid")]:  # fmt: skip
        with pytest.raises(mixprec.MixprecError, match=match):
            LowMemAdamW(params, weights="kahan", **kwargs)
    with pytest.raises(mixprec.PolicyError, match="momentum=-0.5 is invalid"):
        LowMemSGD(params, momentum=-0.5, weights="kahan")


# ---------------------------------------------------------------------- checkpoints


def _o4(model, **kw):
    return mixprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O4", **kw)


@pytest.mark.parametrize("weights", ["stochastic", "kahan", "split"])
def test_state_dict_round_trips_exactly_and_loads_weights_only(weights):
    model, opt = _o4(_mlp(width=128), master_weights=weights)
    batches = _batches(6)
    for x, y in batches[:3]:
        opt.zero_grad()
        with mixprec.scale_loss(F.cross_entropy(model(x), y), opt) as s:
            s.backward()
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2, opt2 = _o4(_mlp(seed=5, width=128), master_weights=weights)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert _bitwise(_state_bits(opt), _state_bits(opt2))  # dtypes too (fp32 block maxima)
    for m, o in ((model, opt), (model2, opt2)):
        for x, y in batches[3:]:
            o.zero_grad()
            with mixprec.scale_loss(F.cross_entropy(m(x), y), o) as s:
                s.backward()
            o.step()
    assert _bitwise(_state_bits(opt), _state_bits(opt2))  # the same random bits after resuming


def test_a_state_dict_whose_state_does_not_fit_is_refused_and_nothing_changes():
    model, opt = _o4(_mlp(width=128))
    x, y = _batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    opt.step()
    sd = opt.state_dict()
    before = _state_bits(opt)
    broken = {**sd, "state": {k: dict(v) for k, v in sd["state"].items()}}
    big = next(k for k, v in broken["state"].items() if v["exp_avg"].dtype == torch.int32)
    broken["state"][big]["exp_avg"] = broken["state"][big]["exp_avg"].float()  # not codes
    with pytest.raises(ValueError, match="does not fit"):
        opt.load_state_dict(broken)
    assert _bitwise(before, _state_bits(opt))
    # A consistent state dict of another configuration brings its settings with it, as
    # torch's optimizers take their hyperparameters from the checkpoint.
    other_model, other = _o4(_mlp(width=128), optimizer_states="fp32")
    other.load_state_dict(sd)
    assert other.param_groups[0]["states"] == "8bit-bound"  # O4's

    # Its state is the checkpoint's, tensor for tensor (the parameters are the new model's).
    def states(o):
        inner = getattr(o, "optimizer", o)
        return [v for g in inner.param_groups for q in g["params"]
                for v in inner.state.get(q, {}).values() if torch.is_tensor(v)]  # fmt: skip

    assert _bitwise(states(opt), states(other))
    F.cross_entropy(other_model(x), y).backward()
    other.step()  # runs with the loaded 8-bit layout


# ---------------------------------------------------------------------- the opt level


def test_o4_describes_itself_and_replaces_the_optimizer():
    text = str(mixprec.describe("O4", device_type="cpu"))
    assert "6 bytes per parameter" in text and "optimizer_states       = 8bit" in text
    assert mixprec.describe("O4", device_type="cuda").dtype == torch.bfloat16
    model = _mlp()
    user = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = mixprec.initialize(model, user, "O4")
    assert isinstance(opt.optimizer, LowMemSGD) and opt.optimizer.param_groups[0]["momentum"] == 0.9
    assert not user.state and model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32  # normalization layers stay fp32


def test_unsupported_optimizers_are_refused_before_the_model_changes():
    model = _mlp()
    with pytest.raises(mixprec.PolicyError, match="RMSprop"):
        mixprec.initialize(model, torch.optim.RMSprop(model.parameters()), "O4")
    assert model[0].weight.dtype == torch.float32 and mixprec.levels.model is not None
    with pytest.raises(mixprec.PolicyError, match="bf16"):
        mixprec.initialize(model, torch.optim.AdamW(model.parameters()), "O4", dtype="fp16")
    with pytest.raises(mixprec.PolicyError, match="low-precision"):
        mixprec.initialize(model, torch.optim.AdamW(model.parameters()), "O1",
                           master_weights="kahan")  # fmt: skip
    assert model[0].weight.dtype == torch.float32


def test_o3_freezes_a_small_update_that_o4_and_split_keep():
    # The opt-level check of the issue: 120 updates of 1e-4 to bf16 weights of 1.0 (each
    # below half a bf16 ulp, 2^-8): fp64 says 1.012.
    held, weights = {}, {}
    for level, kw in (("O2", {}), ("O3", {}), ("O4", {}), ("O4", {"master_weights": "kahan"}),
                      ("O2", {"master_weights": "split"})):  # fmt: skip
        model = torch.nn.Linear(64, 64, bias=False)
        torch.nn.init.constant_(model.weight, 1.0)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4 * 64)
        model, opt = mixprec.initialize(model, opt, level, **kw)
        for _ in range(120):
            opt.zero_grad()
            with mixprec.scale_loss(-model(torch.ones(1, 64)).float().sum() / 64, opt) as s:
                s.backward()
            opt.step()
        key = (level, kw.get("master_weights"))
        w = model.weight.detach()
        state = opt.optimizer.state.get(model.weight, {})
        value = (opt._masters[0] if opt._masters
                 else join_master(w, unpack_halves(state["lo"], w.numel()).view(w.shape))
                 if "lo" in state else w.float() + state["comp"].float()
                 if "comp" in state else w.float())  # fmt: skip
        held[key], weights[key] = value.mean().item(), w.float().mean().item()
    assert weights[("O3", None)] == 1.0  # every update lost
    for key in (("O2", None), ("O4", None), ("O4", "kahan"), ("O2", "split")):
        assert abs(held[key] - 1.012) < 1e-3, (key, held)
        assert weights[key] > 1.007, (key, weights)  # the bf16 weights moved (1 ulp: 1.0078)
    assert held[("O2", "split")] == held[("O2", None)]  # the same fp32 master


def test_gradient_accumulation_and_clipping_go_through_the_low_memory_step():
    # Reference: the same O4 model stepped by hand (backward, clip, the inner optimizer).
    (model, opt), (ref_model, ref) = _o4(_mlp(width=128)), _o4(_mlp(width=128))
    batches = _batches(4)
    opt.zero_grad()
    for x, y in batches:  # four micro-batches, one step
        with mixprec.scale_loss(F.cross_entropy(model(x), y) / 4, opt) as s:
            s.backward()
        F.cross_entropy(ref_model(x), y).div(4).backward()
    grads = [p.grad.clone() for p in ref_model.parameters()]
    total = torch.nn.utils.clip_grad_norm_(mixprec.master_params(opt), 0.1)
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.1)
    assert total > 0.1  # clipping changed the gradients
    assert not torch.equal(grads[0], ref_model[0].weight.grad)
    opt.step()
    ref.optimizer.step()
    assert _bitwise([p.detach() for p in model.parameters()],
                    [p.detach() for p in ref_model.parameters()])  # fmt: skip
    assert _bitwise(_state_bits(opt), _state_bits(ref))


# ---------------------------------------------------------------------- TrainStep


def _steps(compile_arg, **kw):
    model = _mlp(width=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return mixprec.TrainStep(model, opt, F.cross_entropy, opt_level="O4", compile=compile_arg, **kw)


@pytest.mark.compile
@pytest.mark.parametrize(("weights", "states"), [("stochastic", "8bit"), ("kahan", "8bit"),
                                                 ("split", "8bit"),
                                                 ("stochastic", "8bit-bound")])  # fmt: skip
def test_trainstep_compiled_rounds_as_eager_and_skips_exactly(weights, states):
    # The compiled backward's gradients may differ from eager autograd's in the last bit
    # (decomposed ops), so the runs agree to rounding, not bit for bit; the optimizer's own
    # arithmetic is compared bit for bit, with equal gradients, in
    # test_the_compiled_update_is_the_eager_one.
    overflows = {2, 5}
    kw = {"master_weights": weights, "optimizer_states": states, "loss_scale": "dynamic"}
    eager, step = _steps(False, **kw), _steps(FAST, **kw)
    for i, (x, y) in enumerate(_batches(7, overflows)):
        before = _state_bits(step.optimizer)
        want, got = eager(x, y), step(x, y)
        if i in overflows:
            assert _bitwise(before, _state_bits(step.optimizer)), i  # codes, comp, keys too
        if i > 0:
            assert step.compiled, step.reason
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-4, atol=0)
    low = [p for p in step.model.parameters() if p.dtype == torch.bfloat16]
    theirs = [p for p in eager.model.parameters() if p.dtype == torch.bfloat16]
    same = sum(int(torch.eq(a, b).sum()) for a, b in zip(low, theirs, strict=True))
    assert same >= 0.99 * sum(p.numel() for p in low)
    for a, b in zip(low, theirs, strict=True):  # the rest one rounding step apart
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=2**-7, atol=1e-6)
    assert step.scaler.stats()["losses"][0]["skipped"] >= len(overflows)
    assert "LowMemAdamW" in step.reason


@pytest.mark.compile
def test_inductor_compiled_step_rounds_with_eagers_bits():
    # The real compiler on the optimizer's step alone (TrainStep's update graph runs this same
    # body): the counter-hash bits are integer ops, so inductor's code rounds as eager does.
    def make():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 80).bfloat16())]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = LowMemAdamW(params, lr=torch.tensor(1e-3), min_quantized=1024)
        opt.step()  # creates the state eagerly, as TrainStep does
        return params, opt

    (p_eager, eager), (p_comp, comp) = make(), make()
    compiled = torch.compile(lambda: LowMemAdamW.step(comp), backend="inductor", fullgraph=True)
    for _ in range(3):
        eager.step()
        compiled()
    for a, b in zip(p_comp, p_eager, strict=True):
        # fp32 arithmetic may differ by an ulp before rounding (fused multiply-adds): allow
        # that to move a rare weight by one bf16 ulp; the rest, and all random bits, agree.
        differ = (a != b).float().mean().item()
        assert differ < 0.01
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=0)
    assert torch.equal(comp.state[p_comp[0]]["step"], eager.state[p_eager[0]]["step"])


@pytest.mark.parametrize("name", sorted(TORCH_TWINS))
@pytest.mark.parametrize("weights", ["stochastic", "kahan", "split"])
@pytest.mark.parametrize("states", ["8bit", "8bit-bound"])
def test_the_planewise_update_has_the_whole_tensor_updates_bits(name, weights, states):
    # What a compiled step runs (plane by plane, `planewise`) against the eager whole-tensor
    # update: the same elementwise arithmetic, blocks, random bits, so the same bits. A 96x128
    # weight (12 x 1024: no padding) goes plane by plane; 100x96 (padded) never does.
    _, ours_fn = TORCH_TWINS[name]
    runs = []
    for planewise in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 96), torch.nn.ReLU(),
                                    torch.nn.Linear(96, 100)).bfloat16()  # fmt: skip
        opt = ours_fn(model.parameters(), weights=weights, states=states, min_quantized=1024)
        opt.planewise = planewise
        _train(model, opt, _batches(4))
        assert opt._planewise(opt.param_groups[0], model[2].weight.view(-1)) is planewise
        assert not opt._planewise(opt.param_groups[0], model[4].weight.view(-1))
        runs.append(_state_bits(opt))
    assert _bitwise(*runs)


def test_8bit_bound_codes_moments_against_a_bound_known_before_the_step():
    # states='8bit-bound': each block's scale is the update rule applied to the largest value
    # the old codes decode to and the gradient's block maximum, so a compiled step encodes in
    # the pass that computes the moments. Every decoded value stays within its scale; '8bit'
    # keeps the blocks' maxima.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    opt = LowMemAdamW([p], lr=1e-2, states="8bit-bound", min_quantized=1024)
    sgd_p = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    sgd = LowMemSGD([sgd_p], lr=1e-2, momentum=0.9, dampening=0.5, states="8bit-bound",
                    min_quantized=1024)  # fmt: skip
    exact_p = torch.nn.Parameter(p.detach().clone())
    exact = LowMemAdamW([exact_p], lr=1e-2, states="8bit", min_quantized=1024)
    rules = {"exp_avg": lambda a, g: a + (g - a) * (1 - 0.9),
             "exp_avg_sq": lambda a, g: a * 0.999 + (1 - 0.999) * g * g,
             "momentum_buffer": lambda a, g: a * 0.9 + 0.5 * g}  # fmt: skip
    for i in range(12):
        size = 4.0 if i == 3 else 1.0  # one large step, then the scales decay
        p.grad = (torch.randn(64, 64) * size).bfloat16()
        sgd_p.grad, exact_p.grad = p.grad.clone(), p.grad.clone()
        old = {k: v.clone() for k, v in opt.state[p].items()}
        old_sgd = {k: v.clone() for k, v in sgd.state[sgd_p].items()}
        for o in (opt, sgd, exact):
            o.step()
        gmax = codes.block_max(p.grad.float(), 256, 16)
        for state, before, name, signed in ((opt.state[p], old, "exp_avg", True),
                                             (opt.state[p], old, "exp_avg_sq", False),
                                             (sgd.state[sgd_p], old_sgd, "momentum_buffer",
                                              True)):  # fmt: skip
            scale = state[name + "_absmax"]
            top = codes.dequantize(state[name], scale, signed, p.shape).abs().view(16, 256)
            assert (top.amax(1) <= scale).all(), (i, name)
            if before:  # (SGD's first step takes the gradient itself: its maxima)
                held = codes.dequantize(before[name], before[name + "_absmax"], signed, p.shape)
                peak = held.abs().view(16, 256).amax(1)
                assert torch.equal(codes.peaks(before[name], before[name + "_absmax"], signed),
                                   peak)  # fmt: skip
                assert torch.equal(scale, rules[name](peak, gmax)), (i, name)
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            state = exact.state[exact_p]
            top = codes.dequantize(state[name], state[name + "_absmax"], signed, p.shape)
            # '8bit': the block's largest value is coded as its scale, exactly.
            assert torch.equal(top.abs().view(16, 256).amax(1), state[name + "_absmax"])


def test_codes_against_a_bound_round_stochastically_so_a_value_near_the_scale_does_not_drift():
    # A block's top value within half a code step of its bound is stored, rounded to nearest,
    # as the bound itself; an optimizer starting its next step from that value drifts upward
    # (O4's second moments did, costing 1.3% of the char GPT's validation loss). With noise,
    # the decoded value is right on average, and the noise is the counter hash's: the same
    # stream gives the same codes.
    x = torch.full((1024,), 0.9985)
    x[::7] = 0.25
    scale = torch.ones(4)
    nearest = codes.dequantize(*codes.quantize(x, 256, False, scale), False, x.shape)
    assert torch.equal(nearest[1:7], torch.ones(6))  # stored as the bound: +0.15%
    decoded = []
    for step in range(64):
        stream = counter_stream(torch.tensor(7), torch.tensor(float(step)))
        noise = uniform(stream, 1024)
        words, scales = codes.quantize(x, 256, False, scale, noise)
        assert torch.equal(words, codes.quantize(x, 256, False, scale, uniform(stream, 1024))[0])
        decoded.append(codes.dequantize(words, scales, False, x.shape))
    mean = torch.stack(decoded).mean(0)
    torch.testing.assert_close(mean, x, rtol=5e-3, atol=0)  # unbiased, to 64 draws
    near = x == 0.9985  # on average over those values: no drift, where nearest adds 0.0015
    assert (torch.stack(decoded)[:, near].mean() - 0.9985).abs() < 0.1 * 0.0015
    assert not torch.isin(torch.stack(decoded), torch.tensor([0.0])).any()  # no zero codes


def test_a_checkpoint_without_the_codes_seed_gets_the_one_its_optimizer_would_have_drawn():
    # '8bit-bound' draws random bits whatever the weights mode; a state dict saved before it
    # did (weights='kahan': no seed) loads with the seed a fresh optimizer draws, and steps.
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64).bfloat16()) for _ in range(2)]
    opt = LowMemAdamW(params, weights="kahan", states="8bit-bound", min_quantized=1024)
    for p in params:
        p.grad = torch.randn(64, 64).bfloat16()
    opt.step()
    saved = opt.state_dict()
    old = {**saved, "state": {k: {n: t for n, t in v.items() if n != "key"}
                              for k, v in saved["state"].items()}}  # fmt: skip
    fresh = LowMemAdamW([torch.nn.Parameter(p.detach().clone()) for p in params],
                        weights="kahan", states="8bit-bound", min_quantized=1024)  # fmt: skip
    fresh.load_state_dict(old)
    for a, b in zip(opt.state.values(), fresh.state.values(), strict=True):
        assert torch.equal(a["key"], b["key"])
    for p in fresh.param_groups[0]["params"]:
        p.grad = torch.randn(64, 64).bfloat16()
    fresh.step()


def test_8bit_bound_scales_stay_near_the_blocks_maxima_under_noisy_gradients():
    # The bound starts from what the old codes hold, not from the old bound: its looseness
    # does not build up. Noisy gradients make Adam's moments much smaller than the gradients'
    # block maxima; a bound carried from step to step (the old scale through the rule) sat
    # 4x (first moment) and 6.5x (second) above the blocks' maxima here after 100 steps.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    exact_p = torch.nn.Parameter(p.detach().clone())
    bound = LowMemAdamW([p], lr=1e-3, states="8bit-bound", min_quantized=1024)
    exact = LowMemAdamW([exact_p], lr=1e-3, states="8bit", min_quantized=1024)
    carried = {"exp_avg": torch.zeros(16), "exp_avg_sq": torch.zeros(16)}
    for _ in range(100):
        g = (torch.randn(64, 64) + 0.1).bfloat16()
        p.grad, exact_p.grad = g.clone(), g.clone()
        bound.step()
        exact.step()
        gmax = codes.block_max(g.float(), 256, 16)
        carried["exp_avg"] += (gmax - carried["exp_avg"]) * 0.1
        carried["exp_avg_sq"] = carried["exp_avg_sq"] * 0.999 + 0.001 * gmax * gmax
    for name, most in (("exp_avg", 1.6), ("exp_avg_sq", 1.2)):
        maxima = exact.state[exact_p][name + "_absmax"]
        assert (bound.state[p][name + "_absmax"] / maxima).median() < most, name
        assert (carried[name] / maxima).median() > 3, name  # what carrying the bound gives


@pytest.mark.compile
@pytest.mark.parametrize("states", ["8bit", "8bit-bound"])
@pytest.mark.parametrize("kind", ["adamw-stochastic", "adamw-kahan", "adamw-split", "sgd"])
def test_the_compiled_update_is_the_eager_one(kind, states):
    # Equal gradients, the first step eager (it creates the state), then compiled (plane by
    # plane) against eager: the same bits in every weight, moment, code and scale.
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
        if kind == "sgd":
            opt = LowMemSGD([p], lr=1e-2, momentum=0.9, states=states, min_quantized=1024)
        else:
            opt = LowMemAdamW([p], lr=1e-2, weights=kind.split("-")[1], states=states,
                              min_quantized=1024)  # fmt: skip
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        for i in range(4):
            p.grad = (torch.randn(64, 64) * (i + 1)).bfloat16()
            (opt.step if i == 0 else step)()
        runs.append([p.detach().clone(), *[v.clone() for v in opt.state[p].values()]])
    assert _bitwise(*runs)


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(33, 31), (64, 64)])
def test_a_split_master_updates_its_two_halves_alike_eager_and_compiled(shape):
    # The whole-tensor split update (fp32 states) works on the tensor's two halves, whose low
    # bits share words; an odd element count leaves the last word's high half unused.
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(*shape).bfloat16())
        opt = LowMemAdamW([p], lr=1e-2, weights="split", states="fp32")
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        for i in range(4):
            p.grad = torch.randn(*shape).bfloat16()
            (opt.step if i == 0 else step)()
        runs.append([p.detach().clone(), *[v.clone() for v in opt.state[p].values()]])
        assert opt.state[p]["lo"].shape == ((shape[0] * shape[1] + 1) // 2,)
    assert _bitwise(*runs)


@pytest.mark.compile
def test_compiled_kahan_keeps_the_weights_rounding_error():
    # Inductor's CPU code computes bf16 values in fp32 and dropped the rounding inside
    # ``new.float()``: the compensation held fp32's rounding error (~1e-8, not the weight's
    # ~1e-3) and the small updates were lost. With the bits read back it is the eager one.
    comps = []
    for compiled in (False, True):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
        opt = LowMemAdamW([p], lr=1e-2, weights="kahan", states="fp32")
        step = torch.compile(opt.step) if compiled else opt.step
        for i in range(3):
            p.grad = torch.randn(64, 64).bfloat16()
            (opt.step if i == 0 else step)()
        comps.append(opt.state[p]["comp"].float())
    eager, comp = comps
    assert comp.abs().max() > 1e-3  # a bf16 weight's rounding error at lr 1e-2
    assert (comp == eager).float().mean() > 0.99
    torch.testing.assert_close(comp, eager, rtol=2**-7, atol=1e-6)


# ---------------------------------------------------------------------- memory


def _issue_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])


def _after_backward(model, opt):
    x = torch.randn(8, 512)
    opt.zero_grad()
    with mixprec.scale_loss(model(x).float().pow(2).mean(), opt) as s:
        s.backward()
    opt.step()
    opt.zero_grad()
    with mixprec.scale_loss(model(x).float().pow(2).mean(), opt) as s:
        s.backward()


def test_memory_report_is_exact_for_fp32_adamw():
    model = _issue_mlp()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    report = memory_report(model, opt)
    n = sum(p.numel() for p in model.parameters())
    assert report.params == n
    assert report.bytes["weights"] == report.bytes["gradients"] == 4 * n
    assert report.bytes["optimizer states"] == 8 * n
    assert report.bytes["counters"] == 4 * 8  # eight fp32 step counters
    assert 16.0 <= report.per_param() < 16.001
    assert "16.000 bytes/parameter" in str(report)


def test_a_split_master_saved_with_int16_low_bits_loads_packed():
    # Before 0.8 the low bits were an int16 tensor shaped like the weight; they are now two
    # to an int32 word. Such a checkpoint loads, packed, and steps on as the packed one does.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(30, 7).bfloat16())  # odd element count: a padded word
    opt = LowMemAdamW([p], lr=1e-2, weights="split", states="fp32")
    p.grad = torch.randn(30, 7).bfloat16()
    opt.step()
    saved = opt.state_dict()
    lo = unpack_halves(saved["state"][0]["lo"], p.numel())
    old_lo = torch.where(lo >= 0x8000, lo - 0x10000, lo).to(torch.int16).view(p.shape)
    old = {**saved, "state": {0: {**saved["state"][0], "lo": old_lo}}}
    fresh = LowMemAdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-2, weights="split",
                        states="fp32")  # fmt: skip
    fresh.load_state_dict(old)
    assert _bitwise(_state_bits(fresh), _state_bits(opt))


@pytest.mark.parametrize(
    ("level", "kw", "most"),
    [("O4", {}, 6.1), ("O4", {"optimizer_states": "8bit"}, 6.1),
     ("O4", {"master_weights": "kahan"}, 8.1),
     ("O2", {"master_weights": "split"}, 14.1), ("O2", {"optimizer_states": "8bit"}, 10.1),
     ("O2", {}, 16.01)],
)  # fmt: skip
def test_low_memory_configurations_meet_their_bytes_per_parameter(level, kw, most):
    model = _issue_mlp()
    model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters()), level, **kw)
    _after_backward(model, opt)
    report = memory_report(model, opt)
    assert report.per_param() <= most, str(report)
    assert report.per_param() >= most - 0.2, str(report)
    assert report.bytes["gradients"] in (2 * report.params, 4 * report.params)


def test_o2_holds_no_more_training_state_than_fp32_between_backward_and_step():
    fp32 = _issue_mlp()
    fp32_opt = torch.optim.AdamW(fp32.parameters())
    for _ in range(2):  # a step, then a backward: gradients and state held
        fp32_opt.zero_grad()
        fp32(torch.randn(8, 512)).pow(2).mean().backward()
        if not fp32_opt.state:
            fp32_opt.step()
    model = _issue_mlp()
    model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters()), "O2",
                                    dtype="bf16")  # fmt: skip
    _after_backward(model, opt)
    o2, ref = memory_report(model, opt), memory_report(fp32, fp32_opt)
    assert o2.per_param() <= ref.per_param(), f"{o2}\n{ref}"
    assert o2.bytes["gradients"] == 2 * o2.params  # bf16, on the model, until the step
    # What clipping reads (master_params) is fp32: the exact upcast, moved into the masters.
    grads = [p.grad.float() for p in model.parameters()]
    masters = list(mixprec.master_params(opt))
    assert all(p.grad is None for p in model.parameters())
    for m, g in zip(masters, grads, strict=True):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, g)
    # Code that clips the optimizer's own groups, as with a plain optimizer, finds them too.
    _after_backward(model, opt)
    grads = [p.grad.float() for p in model.parameters()]
    stepped = [p for g in opt.param_groups for p in g["params"]]
    for m, g in zip(stepped, grads, strict=True):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, g)


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_o2_deferred_gradients_step_exactly_as_moved_ones(micro_batches):
    """bf16 O2 leaves a backward's gradients on the model until the step (or the next
    backward): the trajectory is bitwise the one where each backward's gradients move into
    fp32 at once, micro-batches adding up in fp32."""
    runs = []
    for move_at_once in (False, True):
        model = _mlp()
        model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                        "O2", dtype="bf16")  # fmt: skip
        for i, (x, y) in enumerate(_batches(4 * micro_batches)):
            with mixprec.scale_loss(F.cross_entropy(model(x).float(), y), opt) as s:
                s.backward()
            if move_at_once:
                opt._after_backward()
            if (i + 1) % micro_batches == 0:
                opt.step()
                opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- fp16: the scale inside


def _scaled_run(scaler_cls, dtype, weights, states, overflows=(0, 4), steps=7):
    """A torch.amp-style loop on a low-memory optimizer; checks each skipped step on the way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(),
                                torch.nn.Linear(96, 32)).to(dtype)  # fmt: skip
    opt = LowMemAdamW(model.parameters(), lr=1e-2, weights=weights, states=states,
                      min_quantized=1024)  # fmt: skip
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=3)
    for i, (x, _) in enumerate(_batches(steps, overflows)):
        x = torch.cat([x] * 4, 1).to(dtype)
        scaler.scale(model(x).float().pow(2).mean()).backward()
        before, had_state = _state_bits(opt), bool(opt.state)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i in overflows and had_state:
            assert _bitwise(before, _state_bits(opt)), i  # weights, codes, comp, counters
    return model, opt, scaler


@pytest.mark.parametrize(("dtype", "weights", "states"), [
    (torch.bfloat16, "stochastic", "8bit"), (torch.float16, "kahan", "8bit"),
    (torch.float16, "kahan", "bf16"), (torch.float32, "nearest", "fp32"),
])  # fmt: skip
def test_a_scaler_hands_over_its_scale_and_the_skip_is_exact_with_torchs_scaler_too(
    dtype, weights, states
):
    """torch's fused-optimizer contract: the scaler (mixprec's or torch's) sets grad_scale and
    found_inf; the optimizer unscales in fp32 and skips by itself: no snapshot is held."""
    ours = _scaled_run(mixprec.GradScaler, dtype, weights, states)
    theirs = _scaled_run(torch.amp.GradScaler, dtype, weights, states)
    assert _bitwise([p.detach() for p in ours[0].parameters()],
                    [p.detach() for p in theirs[0].parameters()])  # fmt: skip
    assert ours[2].get_scale() == theirs[2].get_scale()
    steps = {float(s["step"]) for s in ours[1].state.values()}
    assert steps == {5.0}  # 7 steps, 2 skipped (the first one created no state)
    guard = ours[2]._known_guard(ours[1])
    assert guard.mode.value == "fused" and guard.snapshot_bytes == 0


def test_fp16_gradients_below_fp16s_range_still_move_the_weights():
    """Scaled fp16 gradients of 2^-26 (below fp16's smallest subnormal, 2^-24, once unscaled):
    unscaled in place they would be 0 and Adam would not move; divided by the scale in fp32
    inside the update, Adam's first step moves each weight by lr, as fp32 Adam does."""
    w = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.float16))
    ref = torch.nn.Parameter(torch.ones(64, 64))
    opt = LowMemAdamW([w], lr=2**-4, weight_decay=0.0, weights="kahan")
    ref_opt = torch.optim.AdamW([ref], lr=2**-4, weight_decay=0.0)
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale((w.float() * 2**-26).sum()).backward()
    assert w.grad.eq(2**-10).all()  # scaled: representable
    ref.grad = torch.full_like(ref, 2**-26)
    scaler.step(opt)
    ref_opt.step()
    torch.testing.assert_close(w.float(), ref.detach(), rtol=0, atol=1e-3)
    assert w.lt(1.0).all()


def test_o4_fp16_scales_the_loss_skips_exactly_and_refuses_to_clip_scaled_gradients():
    opts = mixprec.describe("O4", dtype="fp16", master_weights="kahan")
    assert re.search(r"loss_scale +\= dynamic .*inside its update", str(opts))
    model = _mlp()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = mixprec.initialize(model, adamw, "O4", dtype="fp16", master_weights="kahan")
    assert opt.scaler is not None
    for i, (x, y) in enumerate(_batches(6, overflows={3})):
        opt.zero_grad()
        with mixprec.scale_loss(F.cross_entropy(model(x.half()).float(), y), opt) as s:
            s.backward()
        if i == 2:
            with pytest.raises(mixprec.MixprecError, match="still scaled.*dtype='bf16'"):
                list(mixprec.master_params(opt))
        before = _state_bits(opt)
        opt.step()
        if i == 3:
            assert _bitwise(before, _state_bits(opt))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.scaler.get_scale() == 2.0**15
    # The torch.amp-style loop: unscale_ (for clipping) names the way that works.
    scaler = mixprec.GradScaler("cpu")
    scaler.scale(F.cross_entropy(model(x.half()).float(), y)).backward()
    with pytest.raises(mixprec.MixprecError, match=r"without unscale_.*in fp32"):
        scaler.unscale_(opt.optimizer)


@pytest.mark.compile
def test_o4_fp16_trainstep_compiled_matches_eager_and_skips_exactly():
    overflows = {2, 5}
    eager = _steps(False, dtype="fp16", master_weights="kahan")
    step = _steps(FAST, dtype="fp16", master_weights="kahan")
    for i, (x, y) in enumerate(_batches(7, overflows)):
        before = _state_bits(step.optimizer)
        want, got = eager(x, y), step(x, y)
        if i in overflows:
            assert _bitwise(before, _state_bits(step.optimizer)), i
        if i > 0:
            assert step.compiled, step.reason
        torch.testing.assert_close(got, want, equal_nan=True)
    # The compiled backward's fp16 gradients may differ from eager's by an fp16 ulp (another
    # order of the same fp32 accumulations), which fp16 weights keep (bf16 rounding hid it).
    for a, b in zip(step.model.parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-10, atol=2**-13)
    assert step.scaler.get_scale() == eager.scaler.get_scale() < 2.0**16


def test_add_param_group_is_checked_like_the_constructor_and_leaves_the_optimizer_as_it_was():
    opt = LowMemAdamW([torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))])
    fp16 = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))
    with pytest.raises(mixprec.PolicyError, match="weights='kahan' for fp16"):
        opt.add_param_group({"params": [fp16]})
    with pytest.raises(mixprec.PolicyError, match="unknown weights mode 'bogus'.*kahan"):
        opt.add_param_group({"params": [fp16], "weights": "bogus"})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": fp16, "weights": "kahan"})  # a lone tensor, as torch takes
    assert opt.param_groups[1]["weights"] == "kahan" and opt.param_groups[1]["params"] == [fp16]


def test_an_unknown_master_weights_lists_every_value_once():
    with pytest.raises(mixprec.PolicyError) as err:
        mixprec.describe("O4", master_weights="foo")
    text = str(err.value)
    assert "unknown master_weights 'foo'. Valid: True or 'fp32', 'stochastic'" in text
    assert "master_weightss" not in text and "\"'" not in text


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_converting_mid_run_follows_torch(kind):
    """torch's SGD keeps no step counter: a converted SGD used to count from 0 and take the
    next gradient as its momentum buffer (0.19 off torch after 3 more steps)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64))
    ref = torch.nn.Parameter(w.detach().clone())
    make = ((lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) if kind == "sgd"
            else (lambda ps: torch.optim.AdamW(ps, lr=1e-2)))  # fmt: skip
    opt, ref_opt = make([w]), make([ref])
    for i in range(6):
        if i == 3:
            opt = converted(opt, weights="nearest", states="fp32")
        w.grad = torch.randn(64, 64)
        ref.grad = w.grad.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_torch_optimizers_state_dict_loads_as_converted_does(kind):
    """A torch AdamW/SGD checkpoint into the low-memory optimizer: its groups lacked our
    settings (a KeyError at the next step); now converted, bit for bit what `converted` gives."""

    def make(ps):
        return (torch.optim.SGD(ps, lr=0.1, momentum=0.9) if kind == "sgd"
                else torch.optim.AdamW(ps, lr=1e-2))  # fmt: skip

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 80).bfloat16()),
              torch.nn.Parameter(torch.randn(80).bfloat16())]  # fmt: skip
    torch_opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    torch_opt.step()
    saved = io.BytesIO()
    torch.save(torch_opt.state_dict(), saved)
    want = converted(torch_opt, min_quantized=1024)
    cls = LowMemSGD if kind == "sgd" else LowMemAdamW
    got = cls(params, **({"momentum": 0.9, "lr": 0.1} if kind == "sgd" else {"lr": 1e-2}),
              min_quantized=1024)  # fmt: skip
    saved.seek(0)
    got.load_state_dict(torch.load(saved, weights_only=True))
    assert _bitwise(_state_bits(got), _state_bits(want))
    group = got.param_groups[0]
    assert group["states"] == "8bit" and group["weights"] == "stochastic"
    got.step()  # steps (a KeyError: 'states' before)


def test_the_integrations_refuse_low_memory_levels_and_o3_with_a_low_memory_optimizer_works():
    """The frameworks build and step their own optimizer, which the integrations wrap but do not
    replace: O4 trained as round-to-nearest bf16 under torch's optimizer while reporting O4.
    Refused, naming the way that works: O3 with a mixprec low-memory optimizer."""
    from mixprec.integrations.engine import AmpConfig, AmpEngine, IntegrationError

    for config in ({"opt_level": "O4"},
                   {"opt_level": "O2", "options": {"optimizer_states": "8bit"}},
                   {"opt_level": "O2", "options": {"optimizer_states": "8bit-bound"}},
                   {"opt_level": "O3", "options": {"master_weights": "stochastic"}}):  # fmt: skip
        with pytest.raises(IntegrationError, match="not supported by the integrations.*O3"):
            AmpConfig(dtype="bf16", **config)
    model = torch.nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    engine = AmpEngine(AmpConfig("O3", dtype="bf16"), "cpu")
    model = engine.convert_module(model)
    opt = engine.wrap_optimizer(LowMemSGD(model.parameters(), lr=1.0))
    for _ in range(50):  # updates of 1e-3: below half a bf16 ulp of 1.0 (2^-8)
        opt.zero_grad()
        model.weight.grad = torch.full_like(model.weight, 1e-3)
        opt.step()
    assert model.weight.dtype == torch.bfloat16
    assert abs(model.weight.float().mean().item() - 0.95) < 0.01  # round to nearest: 1.0
