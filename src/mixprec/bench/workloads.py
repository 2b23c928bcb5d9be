"""The benchmark workloads: the seeds' experiments, at the seeds' sizes (``full``) or CPU sizes.

- ``mlp``: seed 002: 3 x Linear(4096) + ReLU, batch 512, SGD lr 1e-3, MSE (50 batches x 3 epochs).
- ``resnet50``: seed 000: ResNet-50 (torchvision layout, 10 classes), 3 x 32 x 32 inputs,
  batch 128, SGD momentum 0.9.
- ``gpt2``: a GPT-2-small-like decoder, batch 8 x 1024 tokens, fused AdamW on CUDA.

Without ``full``, on a CPU, every workload shrinks to a few seconds per variant while keeping its
structure. Below that, each workload has a ladder of reduced sizes (each about a quarter of the
FLOPs of the one before): the runner steps down it when a time budget cannot hold a size, which
is how ``mixprec bench`` stays within its budget on CPUs whose 16-bit matmuls are 100x slower
than fp32 (`mixprec.bench.budget`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.bench.models import GPT, GPTConfig, ResNet50, seed_mlp

__all__ = ["WORKLOADS", "Workload", "WorkloadSize"]


@dataclass(frozen=True)
class WorkloadSize:
    """The sizes of one run of a workload."""

    description: str
    steps: int
    warmup: int
    params: dict[str, Any]


@dataclass(frozen=True)
class Workload:
    """A model, its data, its loss and its optimizer, at CPU and full sizes.

    `reduced` lists smaller sizes of the same structure, largest first, for time budgets.
    """

    name: str
    title: str
    small: WorkloadSize
    full: WorkloadSize
    build: Callable[[dict[str, Any], str], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    loss: Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor]
    optimizer: Callable[[nn.Module, str], torch.optim.Optimizer]
    reduced: tuple[WorkloadSize, ...] = ()
    #: Estimated FLOPs of one training step at given sizes, for planning a time budget (cheap;
    #: within a factor 1.5 of the count `torch.utils.flop_counter` gives, which the table uses).
    cost: Callable[[dict[str, Any]], float] | None = None

    def size(self, full: bool, device: str) -> WorkloadSize:
        """Full (the seed's) sizes when asked or on a GPU, CPU sizes otherwise."""
        return self.full if (full or device == "cuda") else self.small

    def ladder(self, full: bool, device: str) -> tuple[WorkloadSize, ...]:
        """The default size (`size`) first, then every smaller one, largest first."""
        first = self.size(full, device)
        return (first, *((self.small,) if first is self.full else ()), *self.reduced)


def _mlp(p: dict[str, Any], device: str):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(p["batch"], p["width"], generator=g).to(device)
    y = torch.randn(p["batch"], p["width"], generator=g).to(device)
    return seed_mlp(p["width"]).to(device), (x, y)


def _resnet(p: dict[str, Any], device: str):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(p["batch"], 3, p["image"], p["image"], generator=g).to(device)
    y = torch.randint(0, 10, (p["batch"],), generator=g).to(device)
    return ResNet50(num_classes=10, width=p.get("width", 64)).to(device), (x, y)


def _gpt(p: dict[str, Any], device: str):
    cfg = GPTConfig(**p["config"])
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (p["batch"], cfg.block_size), generator=g)
    return GPT(cfg).to(device), (tokens.to(device),)


def _mlp_cost(p: dict[str, Any]) -> float:
    # 3 forward, 3 weight-gradient and 2 input-gradient products (none for the input itself)
    return 8 * 2.0 * p["batch"] * p["width"] ** 2


def _resnet_cost(p: dict[str, Any]) -> float:
    # 0.165 GFLOP per 32x32 image forward at width 64 (ResNet-50's 4.1 GMAC at 224x224 / 49),
    # x3 with the backward; the deepest stages stop shrinking below 32x32, hence the floor.
    spatial = max(p["image"] / 32, 0.6) ** 2
    return 3 * 0.165e9 * (p.get("width", 64) / 64) ** 2 * p["batch"] * spatial


def _gpt_cost(p: dict[str, Any]) -> float:
    c = GPTConfig(**p["config"])
    tokens = p["batch"] * c.block_size
    weights = 12 * c.n_layer * c.n_embd**2 + c.vocab_size * c.n_embd
    return 6.0 * weights * tokens + 12.0 * c.n_layer * tokens * c.block_size * c.n_embd


def _lm_loss(logits: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    tokens = batch[0]
    return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "mlp", "seed MLP (3 x Linear + ReLU, MSE, SGD)",
            WorkloadSize("width 1024, batch 64", 20, 3, {"width": 1024, "batch": 64}),
            WorkloadSize("width 4096, batch 512 (seed 002)", 150, 10,
                         {"width": 4096, "batch": 512}),
            _mlp,
            lambda out, b: F.mse_loss(out.float(), b[1]),
            lambda m, dev: torch.optim.SGD(m.parameters(), lr=1e-3),
            tuple(WorkloadSize(f"width {w}, batch {b}", 20, 3, {"width": w, "batch": b})
                  for w, b in ((512, 64), (512, 16), (256, 16), (128, 16), (128, 4))),
            _mlp_cost,
        ),
        Workload(
            "resnet50", "ResNet-50 on CIFAR-sized images (SGD, momentum 0.9)",
            WorkloadSize("32x32, batch 8", 6, 2, {"batch": 8, "image": 32}),
            WorkloadSize("32x32, batch 128 (seed 000)", 50, 5, {"batch": 128, "image": 32}),
            _resnet,
            lambda out, b: F.cross_entropy(out.float(), b[1]),
            lambda m, dev: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
            tuple(WorkloadSize(f"{i}x{i}, batch {b}" + (f", width {w} (of 64)" if w != 64 else ""),
                               6, 2, {"batch": b, "image": i, "width": w})
                  for w, b, i in ((64, 2, 32), (32, 2, 32), (16, 2, 32), (16, 2, 16),
                                  (8, 2, 16))),
            _resnet_cost,
        ),
        Workload(
            "gpt2", "GPT-2-small-like decoder (AdamW)",
            WorkloadSize("2 layers, d 128, T 128, batch 4", 10, 2,
                         {"batch": 4, "config": {"vocab_size": 1024, "block_size": 128,
                                                 "n_layer": 2, "n_head": 4, "n_embd": 128}}),
            WorkloadSize("12 layers, d 768, T 1024, batch 8 (GPT-2 small)", 30, 5,
                         {"batch": 8, "config": {}}),
            _gpt,
            _lm_loss,
            lambda m, dev: torch.optim.AdamW(m.parameters(), lr=3e-4, fused=dev == "cuda"),
            tuple(WorkloadSize(f"{n} layer{'s' * (n > 1)}, d {d}, T {t}, batch {b}", 10, 2,
                               {"batch": b, "config": {"vocab_size": v, "block_size": t,
                                                       "n_layer": n, "n_head": 4, "n_embd": d}})
                  for n, d, t, b, v in ((2, 128, 64, 2, 1024), (2, 64, 64, 2, 512),
                                        (1, 64, 32, 2, 512), (1, 32, 32, 2, 256),
                                        (1, 32, 16, 2, 256))),
            _gpt_cost,
        ),
    )
}  # fmt: skip
