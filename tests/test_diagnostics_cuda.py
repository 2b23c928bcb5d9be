"""Diagnostics on a GPU: the CUDA table's ping-pong, and a watch that never syncs the host."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from tests.test_diagnostics import _Blowup, _CastCounter, _Net, _x

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.gpu,
]


def test_explain_cuda_table_reports_layernorm_ping_pong_and_true_cast_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)).cuda()
    x = torch.randn(4, 16, device="cuda")
    counter = _CastCounter()
    with counter, mixprec.autocast("cuda"):
        model(x)
    report = mixprec.explain(model, x)
    assert report.device_type == "cuda" and report.summary()["dtype"] == "fp16"
    assert [r["category"] for r in report.rows] == ["lower", "fp32", "lower"]
    assert len(report.ping_pong) == 1
    assert report.casts == counter.casts and report.cast_bytes == counter.bytes


@pytest.mark.parametrize("ops", [False, True])
def test_watch_adds_no_host_sync_and_names_the_module(ops):
    # The CPU test's network and batch (the seeds fix them): their forward overflows fp16 at
    # encoder.2; a batch from the CUDA generator might only overflow in the backward.
    bad = _Net(_Blowup()).cuda().half()
    x = _x().cuda().half()
    model = _Net(nn.Identity()).cuda().half()
    with mixprec.watch_nonfinite(model, ops=ops) as watch:
        model(x).float().sum().backward()  # first step: allocations, layout interning
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                model(x).float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert watch.first is None
    with mixprec.watch_nonfinite(bad, ops=ops) as watch:
        bad(x).float().sum().backward()
    assert (watch.first.module, watch.first.phase) == ("encoder.2", "forward")
