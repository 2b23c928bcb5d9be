"""8-bit blockwise quantization of optimizer states, with the dynamic (non-linear) code.

A state tensor is cut into blocks of `block` consecutive elements (256 by default); each block
keeps its absolute maximum in fp32 and its elements as 8-bit indices into a 256-entry code of
values in [-1, 1] (or [0, 1]). Dequantizing is a table lookup times the block's maximum;
quantizing divides by the maximum and picks the nearest code value (a binary search over the
255 midpoints). Costs: 1 byte per element plus 4 bytes per block (1.016 bytes per element at
256); the last block is padded to full length, so a tensor of n elements holds
``ceil(n / block) * block`` codes.

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
a compiled optimizer step (``torch.bucketize`` and an index lookup).
"""

from __future__ import annotations

import itertools
import math

import torch

__all__ = ["BLOCK", "dequantize", "dynamic_code", "midpoints", "padded_size", "quantize"]

#: The default block size (the paper's, and bitsandbytes' and torchao's default).
BLOCK = 256
_DECADES = 7


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


def quantize(
    x: torch.Tensor, mids: torch.Tensor, block: int, positive: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (any shape, fp32) as (uint8 codes of ``padded_size`` elements, fp32 block maxima).

    `positive`: `x` is a second moment (unsigned code, whose value 0 is its first): a positive
    value is never stored as 0.

    `mids` are the 255 midpoints between consecutive code values (`midpoints`): the nearest
    code value of v is the number of midpoints below it. A block of zeros keeps the maximum 0
    (and the code of 0), so it dequantizes to exact zeros.
    """
    flat = x.reshape(-1)
    pad = padded_size(flat.numel(), block) - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normed = blocks / safe.unsqueeze(1)
    index = torch.bucketize(normed, mids)
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
    values = code[codes.long()].view(-1, block) * absmax.unsqueeze(1)
    numel = math.prod(shape)
    return values.view(-1)[:numel].view(shape)


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """The 255 decision boundaries between consecutive code values."""
    return (code[1:] + code[:-1]) / 2
