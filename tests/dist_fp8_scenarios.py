"""FP8 under FSDP2: scenarios the distributed FP8 tests run on every rank of a `RankPool`.

The model has four linear layers of distinct shapes (so every all-gather can be told apart by
its size); ``fp8=auto`` puts the middle two in FP8. Each rank trains on its slice of a global
batch; the reference is one process training the same FP8 model on the same slices as
micro-batches of one optimizer step (`tests.dist_scenarios` says why that is bit for bit: the
halvings are exact, and FP8 scales follow them by exact powers of two).

All-gather bytes are counted from the collectives themselves: a dispatch mode sees every c10d
all-gather FSDP2 issues and adds up the bytes each rank contributes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec
from mixprec.distributed.fp8 import plain_dtensor
from mixprec.distributed.memory import rank_bytes
from mixprec.fp8 import fp8_layers, gemm

ROWS = 8
SIZES = (16, 32, 48, 64, 8)  # layer i maps SIZES[i] -> SIZES[i + 1]
FP8_LAYERS = (2, 4)  # the Sequential indices fp8=auto converts


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(len(SIZES) - 1):
        layers.append(nn.Linear(SIZES[i], SIZES[i + 1]))
        if i < len(SIZES) - 2:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


def batch(step: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(ROWS * parts, SIZES[0], generator=g)
    return x, torch.randn(ROWS * parts, SIZES[-1], generator=g)


def part(t: torch.Tensor, r: int) -> torch.Tensor:
    return t[r * ROWS : (r + 1) * ROWS]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y)


class CountAllGathers(TorchDispatchMode):
    """Bytes each all-gather collective takes from this rank, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "allgather" in name.replace("_", "") and name.startswith(("c10d", "_c10d")):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if tensors:  # (output, input) or (input, ...): the smaller is this rank's part
                self.sizes.append(min(t.numel() * t.element_size() for t in tensors))
        return func(*args, **(kwargs or {}))


def _sharded(level: str, recipe: str | None) -> tuple[nn.Module, Any]:
    model = net()
    kw = {"fp8": recipe} if recipe else {}
    mixprec.fully_shard(model, opt_level=level, units=(nn.Linear,), **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return mixprec.initialize(model, opt, level)


def _fp8_state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for _, m in fp8_layers(model)
            for t in (m.fp8_history, m.fp8_scale)]  # fmt: skip


def _params(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        p = plain_dtensor(p.detach())
        out.append(p.full_tensor() if hasattr(p, "full_tensor") else p.clone())
    return out


def fsdp_fp8(rank: int, world: int, level: str, recipe: Any, steps: int = 3,
             compare: bool = True) -> dict[str, Any]:  # fmt: skip
    """FSDP2 + FP8 for `steps` steps, the same model without FP8 beside it (`compare`: its
    all-gathers at step 1), and on rank 0 the one-process run."""
    gemm.set_gemm_path("emulate")  # the same kernels on every rank and in the reference
    out: dict[str, Any] = {}
    runs = (("fp8", recipe, steps), ("bf16", None, 2)) if compare else (("fp8", recipe, steps),)
    for name, fp8, n in runs:
        model, opt = _sharded(level, fp8)
        losses, counted = [], CountAllGathers()
        for step in range(n):
            x, y = batch(step, world)
            opt.zero_grad()
            with counted if step == 1 else contextlib.nullcontext():
                loss = loss_of(model, part(x, rank), part(y, rank))
                with mixprec.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            if step == 1:  # between backward and the step: gradients held
                out[f"{name} memory"] = rank_bytes(model, opt)
            opt.step()
            every = [torch.zeros_like(loss) for _ in range(world)]
            dist.all_gather(every, loss.detach())  # the loss of each micro-batch
            losses.append(torch.stack(every))
        out[name] = {"losses": losses, "gathers": counted.sizes, "params": _params(model)}
        if fp8:
            out[name]["state"] = _fp8_state(model)
            out[name]["reasons"] = [m.fp8_reason for _, m in fp8_layers(model)]
            out[name]["types"] = sorted({type(getattr(p, "_local_tensor", p)).__name__
                                         for p in model.parameters()})  # fmt: skip
    out["ref"] = reference(level, recipe, world, steps) if rank == 0 else None
    gemm.set_gemm_path(None)
    return out


def reference(level: str, recipe: Any, world: int, steps: int) -> dict[str, Any]:
    """One process, no wrapper: each rank's slice is a micro-batch, gradients added in fp32."""
    model = net()
    model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    level, fp8=recipe)  # fmt: skip
    losses = []
    for step in range(steps):
        x, y = batch(step, world)
        opt.zero_grad()
        mine = []
        for r in range(world):
            loss = loss_of(model, part(x, r), part(y, r))
            with mixprec.scale_loss(loss / world, opt) as scaled:
                scaled.backward()
            mine.append(loss.detach())
        opt.step()
        losses.append(torch.stack(mine))
    return {"losses": losses, "params": [m.detach().clone() for m in mixprec.master_params(opt)],
            "state": _fp8_state(model)}  # fmt: skip


def fsdp_fp8_checkpoint(rank: int, world: int, path: str, recipe: str) -> dict[str, Any]:
    """Train 2 steps, save (DCP), train 2 more; a fresh sharded model loads and trains the same
    2 steps: its FP8 state, parameters and losses must be those of the uninterrupted run."""
    gemm.set_gemm_path("emulate")
    runs = {}
    for name in ("through", "resumed"):
        model, opt = _sharded("O2", recipe)
        start = 0
        if name == "resumed":
            mixprec.load_checkpoint(path, model, opt)
            start = 2
        losses = []
        for step in range(start, 4):
            x, y = batch(step, world)
            opt.zero_grad()
            loss = loss_of(model, part(x, rank), part(y, rank))
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            losses.append(loss.detach())
            if name == "through" and step == 1:
                mixprec.save_checkpoint(path, model, opt)
        runs[name] = {"losses": losses[-2:], "params": _params(model), "state": _fp8_state(model)}
    gemm.set_gemm_path(None)
    return runs


def fsdp_fp8_errors(rank: int, world: int) -> dict[str, str]:
    """What FP8 on FSDP2 refuses, and the message."""
    out = {}
    model = net()
    mixprec.fully_shard(model, opt_level="O2")
    try:
        mixprec.initialize(model, torch.optim.AdamW(model.parameters()), "O2", fp8="tensorwise")
    except mixprec.MixprecError as err:
        out["fp8 after sharding"] = str(err)
    small = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    try:
        mixprec.fully_shard(small, opt_level="O2", fp8="delayed")
    except mixprec.MixprecError as err:
        out["no layer"] = str(err)
    out["unsharded after refusal"] = type(small[0].weight).__name__
    return out
