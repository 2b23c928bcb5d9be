"""8-bit blockwise quantization of optimizer states: a quartic code, four codes per int32 word.

A state tensor (flattened, padded) is cut into blocks of `block` consecutive elements (256 by
default); each block keeps its absolute maximum in fp32 and each element as an 8-bit code q of
its value relative to that maximum, r = x / max:

- signed (first moments, momentum): q = round(127 * |r|^(1/4)) with r's sign, in [-127, 127];
  the value is ``sign(q) * (|q| / 127)^4 * max``;
- unsigned (second moments): q = round(255 * r^(1/4)) in [0, 255], the value
  ``(q / 255)^4 * max``; a positive value is never stored as 0 (see `quantize`).

Why this code: Adam's moments span several orders of magnitude inside one block, and a linear
8-bit code would round everything below 1/256 of the block's maximum to zero (a second moment
of 0 makes the update divide by eps alone). A code must spend its steps on relative precision
across that range, as the dynamic code of Dettmers et al. ("8-bit Optimizers via Block-wise
Quantization", 2022) does with decimal exponents and linear fractions. The quartic code's step
is about 4/|q| of the value, so relative precision changes smoothly with the distance from the
block's maximum (`code_values`, signed; steps between neighbours): 3.1-5.4% within a tenth of
it, 5.5-9.4% down to a hundredth, 9.6-16% down to a thousandth, against the dynamic code's
sawtooth 0.7-12%, 2.9-20% and 5.8-31%; its smallest non-zero value is 3.8e-9 of the maximum
(the dynamic code's 5.5e-7). The unsigned code has twice the resolution. What decides
it is the cost of the step: the dynamic code needs a table lookup to decode and a search over
its 255 midpoints to encode, which compiled code on a CPU runs as scalar loads (a compiled O4
step on an AVX2 CPU spent 15 ms per 512x512 weight there); the quartic code is two square roots
to encode and three multiplications to decode, vectorized like the rest of the update, and
exactly the same eagerly and compiled (square roots and products are correctly rounded).

Layout: the padded tensor of L elements is read as 4 planes of L/4 consecutive elements; word j
holds plane k's code j in its byte k. So each plane decodes from whole int32 words with a shift
and a mask (no byte-wide loads, which compiled CPU code reads slowly), and the four planes are
the tensor's four contiguous quarters, so block b of the tensor is still elements
b*block ... (b+1)*block - 1 and its maximum is ``absmax[b]``. Costs: 1 byte per element plus 4
bytes per block (1.016 bytes per element at 256); L is a multiple of 4 * block.

Everything here is plain tensor code: no host syncs, no data-dependent Python, so it traces into
a compiled optimizer step.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BLOCK", "PLANES", "block_max", "code_values", "dequantize", "dequantize_plane",
           "pack", "padded_size", "peaks", "plane_peak", "quantize", "quantize_plane"]  # fmt: skip

#: The default block size (the paper's, and bitsandbytes' and torchao's default).
BLOCK = 256
#: Codes per int32 word.
PLANES = 4


def _levels(signed: bool) -> int:
    return 127 if signed else 255


def code_values(signed: bool) -> torch.Tensor:
    """The sorted fp32 values the code can hold, relative to the block's maximum."""
    n = _levels(signed)
    q = torch.arange(-n if signed else 0, n + 1, dtype=torch.int32)
    return _value(q, signed)


def padded_size(numel: int, block: int) -> int:
    """Elements held for a tensor of `numel` elements: whole blocks in each of the 4 planes."""
    return math.ceil(numel / (PLANES * block)) * PLANES * block


def _value(q: torch.Tensor, signed: bool) -> torch.Tensor:
    """The normalized value of int32 codes `q` (in [-127, 127] or [0, 255])."""
    t = q.float() * (1.0 / _levels(signed))
    if signed:
        s = t * t.abs()
        return s * s.abs()
    s = t * t
    return s * s


def quantize_plane(
    plane: torch.Tensor,
    block: int,
    signed: bool,
    scale: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One plane (1-D fp32, whole blocks) as (int32 codes in [0, 255], fp32 block scales).

    The codes are bytes in int32 lanes (signed codes in two's complement); `quantize` shifts
    each plane's into its byte of the words. `scale` (one per block) is used instead of the
    blocks' maxima where given (see `quantize`); `noise` (values in [0, 1), `plane`'s shape)
    rounds the codes stochastically instead of to nearest.
    """
    levels = float(_levels(signed))
    blocks = plane.view(-1, block)
    absmax = blocks.abs().amax(dim=1) if scale is None else scale
    inverse = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    r = (blocks.abs() * inverse.unsqueeze(1)).view(-1)
    x = r.sqrt().sqrt() * levels
    q = (torch.round(x) if noise is None else torch.floor(x + noise)).clamp(max=levels)
    q = q.to(torch.int32)
    # The sign from `plane`, and each intermediate used once: compiled, a value used twice
    # that reads more than 4 tensors is written to memory and read back (inductor's CPU
    # heuristic), which made the 8-bit step's one pass two.
    if signed:
        return (q * (1 - 2 * (plane < 0).to(torch.int32))) & 0xFF, absmax
    # Zero is kept for exact zeros only (see `quantize`).
    return torch.where(plane > 0, q.clamp(min=1), torch.zeros_like(q)), absmax


def dequantize_plane(
    words: torch.Tensor, absmax: torch.Tensor, plane: int, signed: bool
) -> torch.Tensor:
    """Plane `plane` of (`words`, `absmax`) as a 1-D fp32 tensor (`absmax`: that plane's)."""
    block = words.numel() // absmax.numel()
    q = _plane_codes(words, plane, signed)
    return (_value(q, signed).view(-1, block) * absmax.unsqueeze(1)).view(-1)


def quantize(
    x: torch.Tensor,
    block: int,
    signed: bool,
    scale: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (any shape, fp32) as (int32 words, ``padded_size / 4``; fp32 block scales).

    A block's scale is its absolute maximum, or `scale` (one value per block) where given:
    any upper bound of the block's magnitudes (a value above its scale is coded as the
    scale). A bound known before the values are is what lets a compiled optimizer step
    encode in the same pass that computes them (`mixprec.optim.lowmem`). `noise` (values in
    [0, 1), one per element of the padded tensor) rounds each code up with the probability
    of its fraction instead of to nearest: against a bound, a value close to the scale would
    otherwise always be stored as the scale itself, and an optimizer that starts the next
    step from that value drifts upward step after step.

    Unsigned (`signed=False`, second moments): zero is kept for exact zeros only. A small
    positive second moment rounded to 0 would make Adam divide its first moment by eps alone
    (an update of lr * m / eps, the "zero-point problem" of Li et al., 2023); the smallest code
    value instead overestimates it, which shrinks that update. A block of zeros keeps the
    maximum 0 and codes 0, so it dequantizes to exact zeros.
    """
    flat = x.reshape(-1)
    pad = padded_size(flat.numel(), block) - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    scales = [None] * PLANES if scale is None else list(scale.view(PLANES, -1))
    noises = [None] * PLANES if noise is None else list(noise.view(PLANES, -1))
    parts = zip(flat.view(PLANES, -1), scales, noises, strict=True)
    planes = [quantize_plane(plane, block, signed, s, n) for plane, s, n in parts]
    return pack([q for q, _ in planes]), torch.cat([absmax for _, absmax in planes])


def block_max(x: torch.Tensor, block: int, blocks: int) -> torch.Tensor:
    """The absolute maximum of each of `blocks` blocks of `block` elements of `x` (flattened,
    zero-padded at the end to that many, as `quantize` pads): fp32, one per block."""
    flat = x.reshape(-1)
    pad = blocks * block - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(blocks, block).abs().amax(dim=1)


def plane_peak(words: torch.Tensor, absmax: torch.Tensor, plane: int, signed: bool) -> torch.Tensor:
    """The largest magnitude each block of plane `plane` of (`words`, `absmax`: that plane's
    scales) decodes to: fp32, one per block; at most the block's scale."""
    # The largest code found in fp32: compiled CPU code reduces an int32 vector to one
    # number lane by lane through memory, an fp32 vector with shuffles (both moments of a
    # 512 x 512 weight: 0.16 ms as int32, 0.05 ms as fp32, call included; AMD EPYC).
    magnitude = _plane_codes(words, plane, signed).abs().float()
    return _value(magnitude.view(absmax.numel(), -1).amax(dim=1), signed) * absmax


def peaks(words: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """`plane_peak` of every plane of (`words`, `absmax`): fp32, one per block."""
    scales = absmax.view(PLANES, -1)
    return torch.cat([plane_peak(words, scales[k], k, signed) for k in range(PLANES)])


def pack(planes: list[torch.Tensor]) -> torch.Tensor:
    """The int32 words holding the `PLANES` planes of codes (`quantize_plane`'s), plane k in
    byte k. A constant shift per plane: inductor fuses the four into one loop over the words
    (a shift by a tensor of plane offsets compiled to slower code)."""
    words = planes[0]
    for k in range(1, PLANES):
        words = words | (planes[k] << (8 * k))
    return words


def _plane_codes(words: torch.Tensor, plane: int, signed: bool) -> torch.Tensor:
    """Plane `plane`'s codes in int32: [-127, 127] signed, [0, 255] unsigned."""
    if signed:  # the byte to the top, and an arithmetic shift back: its two's complement
        return (words << (24 - 8 * plane)) >> 24
    return (words >> (8 * plane)) & 0xFF


def dequantize(
    words: torch.Tensor, absmax: torch.Tensor, signed: bool, shape: torch.Size
) -> torch.Tensor:
    """The fp32 tensor of `shape` that (`words`, `absmax`) hold."""
    planes = [dequantize_plane(words, maxima, k, signed)
              for k, maxima in enumerate(absmax.view(PLANES, -1))]  # fmt: skip
    numel = math.prod(shape)
    return torch.cat(planes)[:numel].view(shape)
