"""A small MLP trained under mixprec.autocast reaches the loss it reaches under torch.autocast.

Both engines insert the same casts in the same places, so on CPU bf16 the two training runs are
expected to agree step for step; the test asserts agreement within noise and also that the run
actually learned (the loss fell well below its start, close to the fp32 run).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import mixprec


def _train(region, steps: int = 150) -> list[float]:
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    w_true = torch.randn(16, 4)
    y = (x @ w_true).argmax(-1)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for i in range(steps):
        idx = torch.arange(i * 32, i * 32 + 32) % 256
        with region():
            loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_mlp_trains_like_torch_autocast():
    theirs = _train(lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    ours = _train(lambda: mixprec.autocast("cpu", dtype=torch.bfloat16))
    fp32 = _train(contextlib.nullcontext)
    tail = slice(-20, None)
    mean = lambda v: sum(v[tail]) / len(v[tail])  # noqa: E731
    assert mean(ours) < 0.5 * ours[0], "did not learn"
    assert abs(mean(ours) - mean(theirs)) < 0.02
    assert abs(mean(ours) - mean(fp32)) < 0.1
    # Same casts in the same places: the trajectories coincide.
    assert ours == theirs
