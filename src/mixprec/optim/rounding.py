"""Writing an fp32 update into a bf16/fp16 weight without losing it: rounding modes.

A bf16 weight w cannot hold w + u when |u| is below half its ulp (2^-9 of |w|): round to
nearest returns w, and a long run of such updates is lost (O3's failure). Three remedies,
each a function of tensors only (traceable, no host syncs):

- stochastic rounding (`stochastic_round`): round up with probability equal to the fraction of
  the ulp that was cut, so the rounded weight equals w + u in expectation and small updates
  accumulate on average (Zamirai et al., "Revisiting BFloat16 Training", 2020). No extra memory.
  bf16 only: bf16 is the top half of fp32, so adding 16 random bits below the cut and
  truncating is the whole operation.
- Kahan compensation (`kahan_add`): a second low-precision buffer keeps what rounding dropped
  and adds it to the next update. 2 bytes per parameter; deterministic; any low dtype.
- split masters (`split_master`, `join_master`): the fp32 master itself, held as the bf16
  weight (its top 16 bits, rounded) plus the 16 bits bf16 drops, two to an int32 word. 2 bytes
  per parameter, and exactly O2's fp32 master arithmetic: what O2 keeps in 4 extra bytes.
- nearest (plain ``.to(dtype)``): the O3 baseline.

The random bits come from a counter-based hash of (seed, step counter, element index), computed
with integer tensor ops: the same seed gives the same bits eagerly and in compiled code (torch's
generators differ between eager and inductor), the counter lives in the optimizer state (it is
checkpointed and restored with it, and held back on a skipped step), and no generator state is
touched. The hash is murmur3's 32-bit finalizer over a Weyl sequence, computed per element in
int32 lanes whose multiplications wrap modulo 2^32 (as torch's integer kernels and inductor's
vector code do): 8 lanes per AVX2 register where int64 had 4, and no 64-bit multiply, which AVX2
lacks (an int64 version of the same hash made stochastic rounding 7 ns per element compiled on
an AVX2 CPU). Logical shifts are arithmetic shifts with the sign bits masked off.
"""

from __future__ import annotations

import torch

__all__ = ["computed_once", "counter_stream", "hash_bits", "join_master", "kahan_add", "mix_seed",
           "pack_halves", "split_master", "stochastic_round", "uniform",
           "unpack_halves"]  # fmt: skip

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # the Weyl increment (2^32 / golden ratio, odd)
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's finalizer constants


def _signed(c: int) -> int:
    """The int32 value with the bits of the 32-bit `c`."""
    c &= _M32
    return c - (1 << 32) if c >= 1 << 31 else c


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int32 `x` by `s` bits."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer on int32 `x` (the 32 bits; products wrap modulo 2^32)."""
    x = x ^ _srl(x, 16)
    x = x * _signed(_C1)
    x = x ^ _srl(x, 13)
    x = x * _signed(_C2)
    return x ^ _srl(x, 16)


def computed_once(t: torch.Tensor) -> torch.Tensor:
    """0-dim (or tiny) `t`, computed once per step when compiled, not inside each element's loop.

    Inductor inlines a 0-dim expression into the loops that read it, where a bias correction's
    libm ``pow`` then runs once per vector (0.8 ms per 262,144 elements on an AVX2 CPU,
    against 0.1 for the whole loop without it); a reduction over two elements is computed once,
    before the loop. The value is `t` exactly (the larger of two equal values). Eagerly `t`
    itself.
    """
    if not torch.compiler.is_compiling():
        return t
    return torch.stack([t, t]).amax(0)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 `x` in [0, 2^32): halves of `c` keep products below 2^48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _to_int32(bits: torch.Tensor) -> torch.Tensor:
    """int64 `bits` in [0, 2^32) as the int32 with those bits."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def mix_seed(seed: int, salt: int) -> int:
    """A per-tensor 32-bit key from the optimizer's seed and a salt (the parameter's index)."""
    x = torch.tensor(_signed(seed * 0x27D4EB2F + salt * _GOLDEN), dtype=torch.int32)
    return int(_fmix32(_fmix32(x))) & _M32


def hash_bits(
    key: torch.Tensor, counter: torch.Tensor, numel: int, offset: int = 0
) -> torch.Tensor:
    """The pseudo-random 32-bit values of elements ``offset ... offset + numel - 1`` (int32
    holding the bits) for step `counter`.

    `key` and `counter` are 0-dim tensors (integer key, whose low 32 bits count; any-dtype
    whole-number counter); element i's value depends on (key, counter, i) only. Transient
    memory: a few int32 tensors of `numel` elements when run eagerly; none when compiled
    (inductor fuses the chain).
    """
    return _element_bits(counter_stream(key, counter), numel, offset)


def counter_stream(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """The 0-dim int32 from which step `counter`'s bits for `key` are drawn (`hash_bits`,
    `stochastic_round`)."""
    low = key.to(torch.int64) & _M32
    count = counter.to(torch.int64) & _M32
    # 0-dim: exact in int64, then the bits as int32.
    return computed_once(_fmix32(_to_int32(low ^ _mul32(count, _GOLDEN))))


def _element_bits(step: torch.Tensor, numel: int, offset: int) -> torch.Tensor:
    """`hash_bits` from the per-step part `step` (`counter_stream`)."""
    device = step.device
    if offset + numel <= 2**31:
        index = torch.arange(offset, offset + numel, device=device, dtype=torch.int32)
    else:  # the index modulo 2^32, as int32 bits
        index = torch.arange(offset, offset + numel, device=device, dtype=torch.int64)
        index = _to_int32(index & _M32)
    return _fmix32(index * _signed(_GOLDEN) + step)


def uniform(stream: torch.Tensor, numel: int, offset: int = 0) -> torch.Tensor:
    """Elements ``offset ... offset + numel - 1``'s fp32 values in [0, 1) from the counter hash
    of `stream` (`counter_stream`): the low 16 bits of each element's `hash_bits`.
    `stochastic_round` takes the high 16 of the same hash, so one stream serves both
    independently, and compiled code computes the hash once for the two."""
    return (_element_bits(stream, numel, offset) & 0xFFFF).float() * 2.0**-16


def stochastic_round(x: torch.Tensor, stream: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """fp32 `x` rounded to bf16 stochastically: up with probability of the dropped fraction.

    The random bits are ``hash_bits(key, counter, x.numel(), offset)`` with `stream` =
    ``counter_stream(key, counter)``: `x` holds elements ``offset ...`` of its tensor. One
    stream serves all the parts of a tensor (the planes of a compiled 8-bit update), so a
    compiled step computes it once per tensor.

    Adds 16 random bits to the bit pattern below bf16's cut and truncates; the sign is apart
    from the magnitude bits, so negative values round away from zero with the same rule.
    Infinities and NaNs stay as they are.
    """
    bits = x.contiguous().view(torch.int32)
    noise = _srl(_element_bits(stream, x.numel(), offset).view(x.shape), 16)
    # No int32 overflow: a finite pattern plus 16 bits stays below the NaN patterns.
    rounded = torch.where(torch.isfinite(x), bits + noise, bits) & -65536
    return rounded.view(torch.float32).to(torch.bfloat16)


def kahan_add(
    w: torch.Tensor, update: torch.Tensor, comp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w + update`` in `w`'s dtype with compensation: (new weight, new compensation).

    The sum is taken in fp32 with the compensation added; what rounding to `w`'s dtype drops
    goes into the new compensation (stored in `comp`'s dtype), so it is applied next time.
    """
    wide = w.float()
    total = update + comp.float()
    new, value = _rounded(wide + total, w.dtype)
    return new, (total - (value - wide)).to(comp.dtype)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` rounded to nearest (even) in 16-bit `dtype`: (that tensor, its fp32 value).

    ``r = x.to(dtype); r.float()`` eagerly, but inductor's CPU code computes 16-bit values in
    fp32 and drops a rounding to 16 bits that is followed by use in fp32 (``x.to(bf16)
    .float()`` compiles to ``x``, and dtype views that cancel are folded away): Kahan's
    compensation was then fp32's rounding error, not the weight's, and the small updates it
    exists to keep were lost. So the value is computed from bits, which cannot be folded:
    for bf16 the rounding itself in int32 lanes (as torch's conversion rounds: add 0x7FFF
    and the kept part's lowest bit, truncate); for fp16 the rounded tensor's bits read
    back (int16 lanes, which compiled CPU code runs one element at a time: slow, but rare).
    """
    if dtype == torch.bfloat16:
        bits = x.contiguous().view(torch.int32)
        up = bits + (0x7FFF + (_srl(bits, 16) & 1))
        value = torch.where(torch.isnan(x), x, (up & -65536).view(torch.float32))
        return value.to(dtype), value
    new = x.to(dtype)
    return new, _fp16_value(new)


def _fp16_value(t: torch.Tensor) -> torch.Tensor:
    """The fp32 values of fp16 `t`, rebuilt from its bits (`_rounded`)."""
    h = t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    sign = torch.where(h >= 0x8000, -1.0, 1.0)
    exponent, mantissa = (h >> 10) & 0x1F, h & 0x3FF
    # Normal and non-finite: re-biased exponent (31 -> 255), mantissa moved up 13 bits.
    biased = torch.where(exponent == 31, 255, exponent + 112)
    normal = ((biased << 23) | (mantissa << 13)).view(torch.float32)
    subnormal = mantissa.float() * 2.0**-24  # exact
    return sign * torch.where(exponent == 0, subnormal, normal)


def split_master(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` as (bf16 weight, its low 16 bits in int32 lanes, [0, 2^16)), from which
    `join_master` rebuilds `x` exactly.

    The weight is `x`'s top 16 bits rounded half up (in magnitude; round to nearest except at
    exact ties, where round-to-nearest-even would make the low bits ambiguous); the low bits'
    top bit says whether the weight was rounded up. Stored two to an int32 word
    (`pack_halves`). No int16 tensor anywhere: compiled CPU code runs a loop that touches one
    element by element (O2 with split masters took 2.42x O2's step that way).
    """
    # int32 lanes throughout (halves of 16 bits never overflow them): twice the elements per
    # vector of the int64 version, the same bits (15% faster compiled on an AVX2 CPU).
    bits = x.contiguous().view(torch.int32)
    low = bits & 0xFFFF
    high = (_srl(bits, 16) + (low >= 0x8000).to(torch.int32)) & 0xFFFF
    # The weight from an fp32 whose low half is zero: an exact conversion (a NaN may come
    # back as another NaN).
    return (_signed16(high) * 65536).view(torch.float32).to(torch.bfloat16), low


def join_master(weight: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """The fp32 master that (bf16 `weight`, low bits `rest` in [0, 2^16)) hold
    (`split_master`'s inverse)."""
    high = _srl(weight.float().contiguous().view(torch.int32), 16)  # bf16 is fp32's top half
    low = rest.to(torch.int32) & 0xFFFF
    high = (high - (low >= 0x8000).to(torch.int32)) & 0xFFFF
    # The top half as a signed number times 2^16, plus the bottom: no int32 overflow.
    return (_signed16(high) * 65536 + low).view(torch.float32)


def pack_halves(low: torch.Tensor) -> torch.Tensor:
    """16-bit values `low` (int32, [0, 2^16); flattened, n of them) two to an int32 word:
    word j holds value j in its low half and value j + ceil(n/2) in its high half, so each
    half of the tensor reads whole words (`unpack_halves`)."""
    flat = low.reshape(-1)
    half = (flat.numel() + 1) // 2
    if flat.numel() % 2:
        flat = torch.nn.functional.pad(flat, (0, 1))
    return flat[:half] | (flat[half:] << 16)


def unpack_halves(words: torch.Tensor, numel: int) -> torch.Tensor:
    """The `numel` 16-bit values (int32, [0, 2^16)) that `pack_halves` put in `words`."""
    return torch.cat([words & 0xFFFF, _srl(words, 16)])[:numel]


def _signed16(half: torch.Tensor) -> torch.Tensor:
    """int32 `half` in [0, 2^16) as the signed 16-bit number with those bits (still int32)."""
    return torch.where(half >= 0x8000, half - 0x10000, half)
