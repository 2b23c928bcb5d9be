"""GradScaler on a GPU: no host sync through a full step (torch's sync debug mode raises on any),
and the scale -> backward -> step -> update sequence captured in a CUDA graph. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixprec
from tests.conftest import requires_cuda

pytestmark = [requires_cuda, pytest.mark.gpu]


def _setup(opt_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **opt_kwargs)
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")
    return model, opt, x, y


@pytest.mark.parametrize(
    "opt_kwargs", [{"fused": True}, {"capturable": True, "foreach": True}], ids=["fused", "restore"]
)
def test_full_step_has_no_sync(opt_kwargs):
    model, opt, x, y = _setup(opt_kwargs)
    scaler = mixprec.GradScaler("cuda")

    def step(inject=False):
        opt.zero_grad(set_to_none=False)
        with mixprec.autocast("cuda"):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if inject:
            model[0].weight.grad.fill_(float("inf"))
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    step()  # creates optimizer state (decided on the host once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step(inject=True)
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scaler.get_scale() == 2.0**15


def test_step_captures_in_a_cuda_graph():
    model, opt, x, y = _setup({"capturable": True, "foreach": True})
    scaler = mixprec.GradScaler("cuda", init_scale=2.0**10)

    def step():
        opt.zero_grad(set_to_none=False)
        with mixprec.autocast("cuda", cache_enabled=False):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    before = scaler.get_scale()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(static_loss)
    assert scaler.get_scale() == before  # no overflow, growth interval not reached
    assert scaler.stats()["losses"][0]["steps"] == 3 + 5  # capture records, does not run
