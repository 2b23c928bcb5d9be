"""8-bit blockwise quantization of optimizer states, with the dynamic (non-linear) code.

A state tensor is cut into blocks of `block` consecutive elements (256 by default); each block
keeps its absolute maximum in fp32 and its elements as 8-bit indices into a 256-entry code of
values in [-1, 1] (or [0, 1]). Dequantizing is a table lookup times the block's maximum;
quantizing divides by the maximum and picks the nearest code value: the number of the 255
midpoints below it, found with two table reads instead of a binary search (`Search`). Costs:
1 byte per element plus 4 bytes per block (1.016 bytes per element at 256); the last block is
padded to full length, so a tensor of n elements holds ``ceil(n / block) * block`` codes.

Why the dynamic code (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022):
Adam's moments span several orders of magnitude inside one block, and a linear 8-bit code
would round everything below 1/256 of the block's maximum to zero (the second moment's small
entries become 0 and the update divides by eps alone). The dynamic code spends its bits like a
floating-point format with a decimal exponent: for each of 7 decades 10^-6 ... 10^0 it keeps a
linear grid of fractions, finer for the larger decades (2^i points for decade i when signed,
twice as many when unsigned), so relative precision is roughly uniform from 1e-6 to 1 and
small values are not flushed. The signed code (first moments, momentum) has 127 values per
sign, 0 and 1; the unsigned code (second moments) has 254 positive values, 0 and 1, and a
positive second moment is never stored as 0 (see `quantize`).

Everything here is plain tensor code: no host syncs, no data-dependent Python, so it traces into
a compiled optimizer step (elementwise integer work and table reads, which inductor fuses into
the update's loop; ``torch.bucketize``'s binary search stays a library call there and was half
of a compiled O4 step on a CPU).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch

__all__ = ["BLOCK", "Search", "dequantize", "dynamic_code", "midpoints", "nearest",
           "padded_size", "quantize", "search_table"]  # fmt: skip

#: The default block size (the paper's, and bitsandbytes' and torchao's default).
BLOCK = 256
_DECADES = 7
# The search's buckets: normalized values whose fp32 bit patterns agree above bit 13, a relative
# width of at most 2^-10, narrower than the closest two midpoints of either code (0.35% apart,
# beside 1.0), so no bucket holds two midpoints (`search_table` checks it).
_SHIFT = 13
_ONE = 0x3F800000  # the bit pattern of 1.0: normalized values lie in [-1, 1]
_KEYS = _ONE >> _SHIFT


def dynamic_code(signed: bool) -> torch.Tensor:
    """The 256 sorted fp32 values of the dynamic code (signed: [-1, 1]; unsigned: [0, 1])."""
    values: list[float] = [0.0, 1.0]
    for i in range(_DECADES):
        points = 2**i if signed else 2 ** (i + 1)
        # The midpoints of `points` equal steps from 0.1 to 1: a linear grid in this decade.
        edges = [0.1 + 0.9 * k / points for k in range(points + 1)]
        mids = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
        scale = 10.0 ** (i - (_DECADES - 1))
        values += [scale * m for m in mids]
        if signed:
            values += [-scale * m for m in mids]
    assert len(values) == 256, len(values)
    return torch.tensor(sorted(values), dtype=torch.float32)


def padded_size(numel: int, block: int) -> int:
    """Elements held for a tensor of `numel` elements: whole blocks."""
    return math.ceil(numel / block) * block


class Search(NamedTuple):
    """What `quantize` needs to find a value's nearest code value (`search_table`).

    Attributes:
        mids: the 255 midpoints between consecutive code values, then +inf (256 entries).
        first: uint8, per bucket of values (the fp32 bit patterns that agree above bit 13,
            ordered): how many midpoints lie below the bucket's lowest value.
    """

    mids: torch.Tensor
    first: torch.Tensor


def _bucket(v: torch.Tensor) -> torch.Tensor:
    """The bucket of each fp32 `v` in [-1, 1] (int32, 0 for -1.0 ... 2 * _KEYS for 1.0).

    The bit pattern, made monotone in the value (negative values count down from 0), shifted:
    a floor division, so each bucket is an interval of values. Out-of-range values (NaN) are
    clamped to the ends. All in int32 (no intermediate leaves its range: the magnitude bits
    are below 2^31): AVX2 has no 64-bit min/max or multiply, and int32 halves the lanes' width.
    Compiled alone on an AVX2 CPU (one thread, 512x512), quantizing took 1.72 ms instead of
    2.63 with int64, dequantizing (int32 indices) 0.92 instead of 1.54; inside the fused
    compiled O4 step, whose table reads inductor emits as scalar loops, it made no measurable
    difference.
    """
    bits = v.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)
    return (ordered >> _SHIFT).clamp(-_KEYS, _KEYS) + _KEYS


def search_table(code: torch.Tensor) -> Search:
    """The `Search` of `code` (256 sorted values) on its device: 255 KiB, built once.

    Raises:
        ValueError: two of `code`'s midpoints are closer than a bucket is wide (not the case
            for `dynamic_code`; a code with finer steps needs a smaller ``_SHIFT``).
    """
    mids = midpoints(code.float())
    keys = torch.arange(-_KEYS, _KEYS + 1, dtype=torch.int64, device=code.device) << _SHIFT
    bits = torch.where(keys < 0, (-keys) | 0x80000000, keys)  # each bucket's lowest value
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    first = torch.bucketize(bits.view(torch.float32), mids)
    if (first[1:] - first[:-1]).max() > 1:
        raise ValueError("two midpoints of this code fall in one search bucket")
    inf = torch.full((1,), math.inf, dtype=mids.dtype, device=mids.device)
    return Search(torch.cat([mids, inf]), first.to(torch.uint8))


def nearest(v: torch.Tensor, search: Search) -> torch.Tensor:
    """The index (int32) of the code value nearest each `v` in [-1, 1]: the number of
    midpoints below `v`, exactly ``torch.bucketize(v, mids)``.

    A bucket holds at most one midpoint, so the count is its lowest value's count, plus one
    where `v` is above the first midpoint at or after that lowest value.
    """
    first = search.first[_bucket(v)].to(torch.int32)
    return first + (v > search.mids[first]).to(torch.int32)


def quantize(
    x: torch.Tensor, search: Search, block: int, positive: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (any shape, fp32) as (uint8 codes of ``padded_size`` elements, fp32 block maxima).

    `positive`: `x` is a second moment (unsigned code, whose value 0 is its first): a positive
    value is never stored as 0.

    `search` is the code's `search_table`: the nearest code value of v is the number of
    midpoints below it (`nearest`). A block of zeros keeps the maximum 0 (and the code of 0),
    so it dequantizes to exact zeros.
    """
    flat = x.reshape(-1)
    pad = padded_size(flat.numel(), block) - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normed = blocks / safe.unsqueeze(1)
    index = nearest(normed, search)
    if positive:
        # Zero is kept for exact zeros only: a small positive second moment rounded to 0 would
        # make Adam divide its first moment by eps alone (an update of lr * m / eps, the
        # "zero-point problem" of Li et al., 2023); the smallest code value instead
        # overestimates it, which shrinks that update.
        index = torch.where((index == 0) & (normed > 0), torch.ones_like(index), index)
    return index.to(torch.uint8).view(-1), absmax


def dequantize(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: torch.Size
) -> torch.Tensor:
    """The fp32 tensor of `shape` that (`codes`, `absmax`) hold."""
    block = codes.numel() // absmax.numel()
    values = code[codes.int()].view(-1, block) * absmax.unsqueeze(1)  # int32: see _bucket
    numel = math.prod(shape)
    return values.view(-1)[:numel].view(shape)


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """The 255 decision boundaries between consecutive code values."""
    return (code[1:] + code[:-1]) / 2
