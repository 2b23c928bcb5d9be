"""The shared vocabulary of the op policy: the categories an op can be in, and a decision record.

The eager autocast engine, the tests and (later) the graph pass all speak in these categories.
Each category carries a one-line explanation that reports print next to every decision.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from mixprec.errors import PolicyError, unknown_value

__all__ = ["Decision", "OpCategory"]


class OpCategory(str, enum.Enum):
    """How an autocast region treats one op.

    Values:
        LOWER: cast floating inputs to the low dtype (bf16/fp16) and run there: matmuls and
            convolutions, which run on tensor cores and accumulate in fp32 internally.
        FP32: cast floating inputs to fp32 and run there: ops whose range or accuracy fp16/bf16
            cannot carry (exp, log, pow, norms, losses, ...).
        FP32_OUTPUT: ask the op for an fp32 result (``dtype=torch.float32``) instead of casting
            its input: reductions such as softmax, sum and cumsum accumulate in fp32 that way
            without materialising an fp32 copy of the input.
        PROMOTE: run in the widest floating dtype among the inputs (fp32 if any input is fp32):
            ops that mix tensors (cat, stack, addcmul, ...) and would otherwise fail or silently
            round an fp32 input.
        BANNED: refuse to run inside an autocast region, with the fix in the message.
        FP8: a *module-level* category: the linear layers the policy's FP8 module rules select
            run their matmuls (forward and both backward products) on scaled FP8 operands, e4m3
            for inputs and weights, e5m2 or e4m3 for gradients, accumulating in fp32 (see
            `mixprec.policy.modules` and `mixprec.Fp8Recipe`). Ops cannot be moved there.
        PASSTHROUGH: no cast; the op runs in whatever dtype its inputs have (the default for every
            op that no table names).
    """

    LOWER = "lower"
    FP32 = "fp32"
    FP32_OUTPUT = "fp32_output"
    PROMOTE = "promote"
    BANNED = "banned"
    FP8 = "fp8"
    PASSTHROUGH = "passthrough"

    @classmethod
    def parse(cls, value: str | OpCategory) -> OpCategory:
        """Accept a category or its name (``'fp32'``, ``'lower'``, ...); list the valid ones."""
        if isinstance(value, OpCategory):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if member.value == key or member.name.lower() == key:
                    return member
            alias = _ALIASES.get(key)
            if alias is not None:
                return alias
        raise PolicyError(
            unknown_value(
                "op category",
                value,
                [m.value for m in cls],
                hint="Aliases: 'half' and 'low' mean 'lower'; 'float' and 'full' mean 'fp32'.",
            )
        )

    @property
    def summary(self) -> str:
        """Why ops of this category run where they run, in one line."""
        return _SUMMARIES[self]

    def __str__(self) -> str:
        return self.value


_ALIASES = {
    "half": OpCategory.LOWER,
    "low": OpCategory.LOWER,
    "lower_precision": OpCategory.LOWER,
    "float": OpCategory.FP32,
    "full": OpCategory.FP32,
    "float32": OpCategory.FP32,
    "none": OpCategory.PASSTHROUGH,
    "input": OpCategory.PASSTHROUGH,
}

_SUMMARIES = {
    OpCategory.LOWER: "matmul/conv class: runs in the low dtype on tensor cores, accumulating "
    "in fp32 inside the kernel",
    OpCategory.FP32: "range- or accuracy-sensitive: inputs are cast to fp32",
    OpCategory.FP32_OUTPUT: "reduction: asked for an fp32 output so it accumulates in fp32 "
    "without an fp32 copy of its input",
    OpCategory.PROMOTE: "mixes inputs: runs in the widest floating input dtype",
    OpCategory.BANNED: "unsafe to autocast: refused with a fix",
    OpCategory.FP8: "linear layer in FP8: scaled e4m3/e5m2 operands on the FP8 tensor cores, "
    "fp32 accumulation, a scale per tensor (or row) kept on the device",
    OpCategory.PASSTHROUGH: "precision-neutral: runs in its input dtype",
}


@dataclass(frozen=True)
class Decision:
    """What a policy decided for one op on one device, and why.

    Attributes:
        op: the op name (``'mm'``) or the qualified name of a user function.
        category: the category the op falls in.
        dtype: the dtype the op computes in when its inputs are eligible (None for PROMOTE,
            which depends on the inputs, and for PASSTHROUGH/BANNED).
        reason: a sentence naming the rule that decided it (base table or policy edit).
    """

    op: str
    category: OpCategory
    dtype: torch.dtype | None
    reason: str

    def __str__(self) -> str:
        where = "" if self.dtype is None else f" -> {str(self.dtype).removeprefix('torch.')}"
        return f"{self.op}: {self.category.value}{where} ({self.reason})"
